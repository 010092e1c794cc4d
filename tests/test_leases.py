"""A request's lease on its model, through a real `serve`: bounded by the request's time limit
even when its client stops reading, never in the way of a drain that waits for it, and never
the cause of a failed load. Real processes, a real stalled socket, a real worker killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from omlx_coordinator.api.common import SEND_GRACE_SECONDS
from tests.conftest import start_server
from tests.helpers.serving import (
    CACHE_FLAGS,
    card,
    complete,
    expected,
    one_fits,
    prompts_for,
    stream,
    two_models,
)
from tests.helpers.waiting import wait_for
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return two_models(tmp_path_factory.mktemp("leases"))


def replica_status(url: str, model: str) -> str:
    st = httpx.get(url + "/cluster/status", timeout=10).json()
    return next(m for m in st["models"] if m["id"] == model)["replicas"][0]["status"]


def worker_pid(url: str, model: str) -> int:
    st = httpx.get(url + "/cluster/status", timeout=10).json()
    return next(w["pid"] for n in st["nodes"] for w in n["workers"] if w["model"] == model)


def test_a_client_that_stops_reading_lets_go_of_its_model(tmp_path):
    """A streaming client that keeps its connection open but reads nothing: the stream ends
    at the request's time limit (and a grace for its last events) rather than holding the
    model's lease, which an unload, an eviction or a waiting load needs ended, for as long as
    the client keeps its socket."""
    along = build_model(tmp_path / "along", "llama", num_layers=4, seed=3,
                        extra_config={"max_position_embeddings": 32768})
    limit = 10
    with start_server(along, "--request-timeout", str(limit), home=tmp_path / "h",
                      keepalive=None) as server:
        # Each token with its 20 best alternatives: the sockets' buffers (4 MiB here) fill
        # within the time limit, and the stream's writes block.
        body = json.dumps({"model": "along", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 20000, "temperature": 0, "ignore_eos": True,
                           "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.connect(("127.0.0.1", port))
            t0 = time.monotonic()
            stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            b"application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n"
                            .encode() + body)
            wait_for(lambda: card(server.url, "along")["leases"] == 1, 30, "the lease")
            wait_for(lambda: card(server.url, "along")["leases"] == 0, limit + 40,
                     "the stalled stream to let go of its lease")
            assert time.monotonic() - t0 < limit + SEND_GRACE_SECONDS + 15
            r = httpx.post(server.url + "/cluster/models/along/unload", timeout=60)
            assert r.status_code == 200, r.text
        assert "read nothing for the rest of its time limit" in server.log_tail(200)


def test_a_request_resuming_after_a_lost_node_is_not_held_by_a_drain(models, tmp_path):
    """alpha streams; a request for beta needs alpha's memory and drains it; alpha's worker
    dies. The alpha request, holding its lease, resumes on alpha's new plan and ends whole;
    then beta loads. Neither waits for the time limit (each waited for the other before)."""
    a, b = models["alpha"], models["beta"]
    pa, pb = prompts_for(a)[0], prompts_for(b)[0]
    long_n = 600
    want_a, want_b = expected(a, [pa], long_n)[0], expected(b, [pb])[0]
    with start_server(a, "--model", f"beta={b}", "--node-memory", one_fits(models), *CACHE_FLAGS,
                      "--request-timeout", "120", home=tmp_path / "home") as server:
        results: dict[str, tuple] = {}
        ta = threading.Thread(target=lambda: results.update(alpha=stream(server.url, "alpha", pa,
                                                                           long_n)))
        ta.start()
        wait_for(lambda: card(server.url, "alpha")["leases"] == 1, 60, "alpha's stream")
        t0 = time.monotonic()
        tb = threading.Thread(target=lambda: results.update(beta=stream(server.url, "beta", pb,
                                                                          12)))
        tb.start()
        wait_for(lambda: replica_status(server.url, "beta").startswith("waiting for alpha"), 30,
                 "beta's load to drain alpha")
        os.kill(worker_pid(server.url, "alpha"), signal.SIGKILL)
        ta.join(150)
        tb.join(150)
        assert results["alpha"][0] == want_a and results["beta"][0] == want_b
        assert time.monotonic() - t0 < 90  # well inside the 120 s limit either waited for


def test_a_load_that_failed_for_want_of_room_is_tried_again(models, tmp_path):
    """beta could not load while alpha was pinned; once alpha is unpinned, a request for beta
    loads it (evicting alpha), rather than every request getting the old failure's 503."""
    a, b = models["alpha"], models["beta"]
    pb = prompts_for(b)[0]
    with start_server(a, "--model", f"beta={b}", "--node-memory", one_fits(models), *CACHE_FLAGS,
                      "--pin", "alpha", home=tmp_path / "home") as server:
        r = httpx.post(server.url + "/cluster/models/beta/load", timeout=60)
        assert r.status_code == 503, r.text
        r = httpx.post(server.url + "/cluster/models/alpha/unpin", timeout=10)
        assert r.status_code == 200, r.text
        assert complete(server.url, "beta", pb)["choices"][0]["text"] == expected(b, [pb])[0]


@pytest.fixture(scope="module")
def gamma(tmp_path_factory) -> Path:
    """A model that needs both alpha's and beta's room (with a 100 MiB node)."""
    return build_model(tmp_path_factory.mktemp("gamma") / "gamma", "llama", num_layers=6,
                       hidden_size=128, seed=5)


def test_a_load_that_evicts_two_models_survives_a_request_for_the_second(models, gamma,
                                                                        tmp_path):
    """gamma needs alpha and beta gone; while alpha unloads, a request for beta arrives. beta
    was drained with alpha, so the load goes on: gamma answers, then beta (loaded again)."""
    a, b = models["alpha"], models["beta"]
    pb, pg = prompts_for(b)[0], prompts_for(gamma)[0]
    with start_server(a, "--model", f"beta={b}", "--model", f"gamma={gamma}", "--node-memory",
                      "100MiB", *CACHE_FLAGS, home=tmp_path / "home") as server:
        complete(server.url, "beta", pb)  # alpha and beta loaded
        results: dict[str, object] = {}
        tg = threading.Thread(target=lambda: results.update(
            gamma=httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": "gamma", "prompt": pg, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})))
        tg.start()
        wait_for(lambda: replica_status(server.url, "alpha") == "unloading"
                 or card(server.url, "alpha")["state"] == "unloaded", 60, "alpha's eviction")
        # Long enough to be still running when beta's turn to unload comes.
        rb = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "beta", "prompt": pb, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True})
        tg.join(150)
        rg = results["gamma"]
        assert rg.status_code == 200, rg.text
        assert rg.json()["choices"][0]["text"] == expected(gamma, [pg])[0]
        assert rb.status_code == 200, rb.text
        assert rb.json()["choices"][0]["text"] == expected(b, [pb], 400)[0]
