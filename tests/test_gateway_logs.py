"""Logs and metrics point at the right thing: unknown model names counted apart, /health polls
out of the access log, `serve` logging its stages (and to --log-file), a refused `join` saying
its fix once and backing off, `status` showing every model's layers."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from omlx_cluster.client import layers_on
from omlx_cluster.node_commands import register_periodically
from omlx_coordinator.frontdoor.access_log import RedactedQuery
from tests.conftest import start_server
from tests.in_process_gateway import app_for, ask
from tests.stub_http import QuietHandler, stub_server


def test_unknown_model_names_are_counted_apart(tiny_model_path: Path) -> None:
    app = app_for(tiny_model_path)
    r = ask(app, "POST", "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    metrics = ask(app, "GET", "/metrics").text
    assert re.search(r'omlx_requests_total\{[^}]*outcome="unknown_model"[^}]*\} 1\.0', metrics)
    assert not re.search(r'omlx_requests_total\{[^}]*outcome="rejected"', metrics)


def test_health_polls_are_not_access_log_lines() -> None:
    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0,
                                 '%s - "%s %s HTTP/%s" %d', ("1.2.3.4:5", "GET", path, "1.1",
                                                             200), None)
    quiet = RedactedQuery()
    assert not quiet.filter(record("/health")) and not quiet.filter(record("/health?x=1"))
    assert quiet.filter(record("/v1/models"))


@pytest.mark.slow
def test_serve_logs_its_stages_and_to_its_log_file(tiny_model_path: Path, tmp_path: Path) -> None:
    log_file = tmp_path / "gateway.log"
    with start_server(tiny_model_path, "--log-file", str(log_file), home=tmp_path / "h") as server:
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 200
        out = server.log_tail(400)
    stages = [line.split(": ", 1)[1] for line in out.splitlines()
              if "omlx_coordinator.status:" in line]
    assert stages[0] == "cluster: starting 1 node(s)", stages
    loading = next(i for i, s in enumerate(stages)
                   if re.match(r"tiny-llama: loading tiny-llama \(plan ", s))
    assert "tiny-llama: ready" in stages[loading:], stages
    assert '"GET /health' not in out  # start_server polled it many times
    written = log_file.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' in written and '"GET /health' not in written
    assert "tiny-llama: ready" in written
    assert log_file.stat().st_mode & 0o777 == 0o600
    # The worker's own log is named for the model and rank it serves, not as the standby it
    # started as.
    worker_logs = list((tmp_path / "h" / "logs").glob("the-shard-worker-of-tiny-llama-rank-0-*"))
    assert len(worker_logs) == 1 and worker_logs[0].stat().st_size > 0


class _WrongSecret(QuietHandler):
    posts: ClassVar[list[float]] = []

    def do_POST(self) -> None:
        self.posts.append(time.monotonic())
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_json(401, {"error": {"message": "registration refused"}})


def test_a_refused_join_backs_off_and_says_the_fix_once(caplog) -> None:
    _WrongSecret.posts.clear()
    with stub_server(_WrongSecret) as url, caplog.at_level(logging.DEBUG,
                                                           logger="omlx_cluster"):
        stop = register_periodically(url.removeprefix("http://"), "127.0.0.1:1", "n1",
                                     "s" * 32, every=0.02, longest=0.16)
        time.sleep(1.2)
        stop.set()
    gaps = [b - a for a, b in zip(_WrongSecret.posts, _WrongSecret.posts[1:])]
    # 0.04, 0.08, then capped at 0.16 s: about 8 tries, not the 60 of a fixed 0.02 s.
    assert 4 <= len(_WrongSecret.posts) <= 12, gaps
    assert max(gaps) >= 0.15
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "--secret-file" in warned[0], warned


def test_status_shows_every_models_layers_on_a_node() -> None:
    models = [{"id": "a", "replicas": [{"replica": 0, "stages": [
        {"node": "n1", "layers": [0, 4]}]}]},
              {"id": "b", "replicas": [{"replica": 0, "stages": [
                  {"node": "n2", "layers": [0, 6]}]}, {"replica": 1, "stages": [
                      {"node": "n1", "layers": [0, 6]}]}]}]
    assert layers_on("n1", models) == "a [0, 4), b#1 [0, 6)"
    assert layers_on("n2", models) == "b [0, 6)"
    assert layers_on("n1", models[:1]) == "[0, 4)"
    assert layers_on("n3", models) == ""
