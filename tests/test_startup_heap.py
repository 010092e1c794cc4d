"""A serving process's full garbage collections skip what it loaded at start: the gateway, the
node agent and the model's shard worker freeze their startup heap (omlx_shared/heap.py), so a
full collection walks only what requests made since, not every module, model and tokenizer
object. Unfrozen, such a collection paused a 2-core machine's gateway or engine for 50-190 ms:
a pause every stream of the process waits out."""

from __future__ import annotations

import pytest
import gc
import json
import os
import time
from pathlib import Path

import httpx

from tests.conftest import REPO, descendants, start_server
from tests.tiny_models import build_model

# Injected into every process of the server through PYTHONPATH: a thread that, once asked (a
# file appears), writes what this process's collector holds.
PROBE = """
import gc, json, os, sys, threading, time
from pathlib import Path

def _answer():
    here = Path(__file__).parent
    while not (here / "ask").exists():
        time.sleep(0.1)
    (here / f"{os.getpid()}.json").write_text(json.dumps({
        "argv": sys.argv, "frozen": gc.get_freeze_count(),
        "generation_2": len(gc.get_objects(generation=2))}))

threading.Thread(target=_answer, daemon=True).start()
"""


def test_freezing_takes_what_is_alive_out_of_every_collection() -> None:
    from omlx_shared.heap import freeze_startup_heap

    held = [[i] for i in range(50_000)]  # a loaded model's worth of small objects
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(held)
        walked = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(o) in walked for o in held[::1000])
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_the_gateway_the_agent_and_the_worker_freeze_their_startup_heap(tmp_path: Path,
                                                                         monkeypatch) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(probe), str(REPO), os.environ.get("PYTHONPATH")])))
    model = build_model(tmp_path / "tiny-heap", "llama", num_layers=2)
    with start_server(model, home=tmp_path / "home") as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.model_id, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        worker = next(w["pid"] for n in status["nodes"] for w in n["workers"])
        agent = status["nodes"][0]["agent_pid"]
        pids = {server.proc.pid, agent, worker}
        assert pids <= {server.proc.pid} | descendants(server.proc.pid)
        (probe / "ask").touch()
        deadline = time.monotonic() + 30
        while not all((probe / f"{p}.json").exists() for p in pids):
            assert time.monotonic() < deadline, f"no answer from {pids}: {server.log_tail()}"
            time.sleep(0.2)
        for pid, role in [(server.proc.pid, "gateway"), (agent, "agent"), (worker, "worker")]:
            heap = json.loads((probe / f"{pid}.json").read_text())
            # Every module each one imported is frozen; a full collection has only what came
            # after to walk.
            assert heap["frozen"] > 20_000, (role, heap)
            assert heap["generation_2"] < heap["frozen"] / 4, (role, heap)
