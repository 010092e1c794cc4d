"""Long steps say how far they are: off a terminal (a log, a pipe, these tests) as lines."""

from __future__ import annotations

import io
import logging
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from rich.console import Console

from omlx_cluster import load_progress
from omlx_cluster.cli import main
from omlx_cluster.load_progress import watch_load
from omlx_shared.progress import ProgressLines
from tests.conftest_models import write_tiny_gguf
from tests.stub_http import QuietHandler, stub_server


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "omlx.progress"]


def test_a_line_per_tenth_while_the_total_grows(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="omlx.progress"):
        lines = ProgressLines("downloading x", 1 << 20)
        for done in range(0, 1 << 20, 1 << 14):
            lines.update(done)
        lines.update(1 << 20, 2 << 20)  # a second file's size became known
        lines.update(2 << 20)
    said = progress_lines(caplog)
    assert said[-1] == "downloading x: 100% (2.00 MiB of 2.00 MiB)"
    assert len(said) <= 10 + 1


def test_import_gguf_says_how_far_it_is(tmp_path: Path, caplog, monkeypatch) -> None:
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0")
    with caplog.at_level(logging.INFO, logger="omlx.progress"):
        assert main(["models", "import-gguf", str(tiny.path)]) == 0
    said = progress_lines(caplog)
    assert said and said[-1].startswith("importing tiny.gguf: 100% (")
    assert said[-1].endswith(" tensors)")


class _Loading(QuietHandler):
    """/cluster/status of a gateway loading model "m": one status after the other."""

    statuses: ClassVar[list[str]] = ["waiting for memory", "loading m (plan 1234abcd)",
                "transferring weights: mac2 40/93 MB", "transferring weights: mac2 93/93 MB",
                "ready"]
    polls = 0

    def do_GET(self) -> None:
        status = self.statuses[min(type(self).polls, len(self.statuses) - 1)]
        type(self).polls += 1
        self.send_json(200, {"models": [{"id": "m", "aliases": [], "replicas": [
            {"replica": 0, "status": status}]}]})


@pytest.fixture
def loading_gateway():
    _Loading.polls = 0
    with stub_server(_Loading) as url:
        yield url


def test_models_load_shows_the_stages(loading_gateway: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr(load_progress, "POLL_SECONDS", 0.01)  # each status once, at once
    done = threading.Event()
    watcher = threading.Thread(target=watch_load, args=(loading_gateway, {}, "m", done,
                                                        Console(file=io.StringIO())))
    watcher.start()
    while _Loading.polls < len(_Loading.statuses) + 1:
        threading.Event().wait(0.01)
    done.set()
    watcher.join(timeout=10)
    assert capsys.readouterr().err.splitlines() == [f"m: {s}" for s in _Loading.statuses]
