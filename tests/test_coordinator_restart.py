"""A coordinator killed with SIGKILL: requests in flight fail at once, a restart finds both
`join` nodes again and serves two models (the main one a pipeline over both) with the same
greedy output and no extra workers, and nodes whose coordinator never comes back unload
their models after --orphan-grace and keep running."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import alive, free_port
from tests.tiny_models import build_model
from tests.helpers.processes import launch, settled_count, status, stop_all
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

ORPHAN_GRACE = 6  # seconds: short, so that the test waits for it
MODELS = ("main", "side")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("restart")
    return {name: build_model(root / name, "llama", num_layers=4, seed=i)
            for i, name in enumerate(MODELS)}


def planned_over_both(url: str) -> bool:
    s = status(url)
    nodes = s.get("nodes") or []
    return (s.get("ready") is True and {n["id"] for n in nodes if n["alive"]} == {"a", "b"}
            and all(n["layers"] for n in nodes))


def complete(url: str, model: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream_until_cut(url: str, model: str, started: threading.Event, outcome: dict) -> None:
    """A long greedy stream; records how it ended."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=httpx.Timeout(60, read=20),
                          json={"model": model, "prompt": [1, 2, 3], "max_tokens": 100_000,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()
        outcome["ended"] = "completed"
    except httpx.HTTPError as e:
        outcome["ended"] = type(e).__name__
    finally:
        started.set()


def test_restart_finds_the_cluster_and_orphans_unload(models, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    coordinator_args = ["coordinator", "--port", str(port), "--no-discovery",
                        "--no-link-probe", "--os-reserve",
                        "1GiB", *(f for n, p in models.items() for f in ("--model", f"{n}={p}"))]
    nodes = {name: launch(["join", "--name", name, "--port", str(free_port()), "--no-announce",
                           "--coordinator", f"127.0.0.1:{port}", "--hot-cache-max-size",
                           "64MiB", "--orphan-grace", str(ORPHAN_GRACE)],
                          tmp_path / f"home-{name}", tmp_path / f"{name}.log")
             for name in ("a", "b")}
    home = tmp_path / "home-coordinator"
    procs = list(nodes.values())
    try:
        coordinator = launch(coordinator_args, home, tmp_path / "coordinator.log")
        procs.append(coordinator)
        wait_for(lambda: planned_over_both(url), 120, "both nodes planned")
        reference = {m: complete(url, m) for m in MODELS}  # the second loads on demand
        s = status(url)
        assert all(len(n["layers"]) for n in s["nodes"]), s
        before = {name: settled_count(p.pid) for name, p in nodes.items()}

        # Streams in flight at the kill end with an error, not a hang.
        outcomes = [{} for _ in MODELS]
        threads = []
        for model, outcome in zip(MODELS, outcomes):
            started = threading.Event()
            t = threading.Thread(target=stream_until_cut, args=(url, model, started, outcome))
            t.start()
            assert started.wait(60)
            threads.append(t)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a stream hung after its coordinator died"
        assert all(o["ended"] != "completed" for o in outcomes), outcomes

        # Started again with the same home and flags: serving within 30 s, same output, the
        # same number of processes on every node.
        t0 = time.monotonic()
        coordinator = launch(coordinator_args, home, tmp_path / "coordinator2.log")
        procs.append(coordinator)
        wait_for(lambda: planned_over_both(url), 30, "a plan over both nodes again")
        assert {m: complete(url, m) for m in MODELS} == reference
        assert time.monotonic() - t0 < 30
        assert {name: settled_count(p.pid) for name, p in nodes.items()} == before
        log = (tmp_path / "coordinator2.log").read_text()
        # One plan over both nodes, not one over the first to register and then a re-plan.
        assert log.count("serving main on 2 stage(s)") == 1 and "serving main on 1" not in log

        # Killed for good: after the grace each node holds no model, and keeps running.
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait(10)
        killed = time.monotonic()
        for name, p in nodes.items():
            wait_for(lambda: (tmp_path / f"{name}.log").read_text().count(
                "no coordinator has called") == 1, ORPHAN_GRACE + 30, f"node {name} to unload")
        assert time.monotonic() - killed >= ORPHAN_GRACE / 2  # (heartbeats lag under load)
        for name, p in nodes.items():
            # Only the standby worker is left, waiting for a plan.
            assert settled_count(p.pid) < before[name], name
            assert alive(p.pid)
    finally:
        stop_all(procs)
