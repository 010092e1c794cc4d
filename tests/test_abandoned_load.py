"""A node lost right as a plan starts loading over it: the load is abandoned within a few
heartbeats instead of holding the cluster's plan lock until a group that can never form times
out, the other agents drop their part, and the model then loads over the nodes left."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import descendants, start_server
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow


def test_a_load_over_a_node_lost_meanwhile_is_abandoned(tiny_model_path, tmp_path):
    side = build_model(tmp_path / "side", "llama", num_layers=4, seed=3)
    with start_server(tiny_model_path, "--nodes", "2", "--model", f"side={side}",
                      home=tmp_path / "h", keepalive=None) as server:
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        side_state = next(m for m in status["models"] if m["id"] == "side")
        if side_state["loaded"]:  # it fit at start: unload it to load it again
            r = httpx.post(server.url + "/cluster/models/side/unload", timeout=60)
            assert r.status_code == 200, r.text
        answer: dict = {}

        def load() -> None:
            t0 = time.monotonic()
            answer["response"] = httpx.post(server.url + "/cluster/models/side/load",
                                            timeout=300)
            answer["seconds"] = time.monotonic() - t0

        # local1's standby worker, stopped, holds its LoadShard open: a tiny model loads in
        # less time than the test takes to see the load start.
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        local1 = next(n for n in status["nodes"] if n["id"] == "local1")
        serving = {w["pid"] for w in local1["workers"]}
        serving |= {c for pid in serving for c in descendants(pid)}
        standby = descendants(local1["agent_pid"]) - serving
        assert standby, "local1 has no standby worker to hold its load open"
        frozen = [local1["agent_pid"], *standby]
        for pid in standby:
            os.kill(pid, signal.SIGSTOP)
        loader = threading.Thread(target=load)
        loader.start()
        deadline = time.monotonic() + 60
        while server.log_tail(5).count("side: loading side (plan") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # its LoadShard is under way on both agents
        os.kill(local1["agent_pid"], signal.SIGSTOP)
        try:
            loader.join(120)
            assert not loader.is_alive(), "the load never gave up on the stopped node"
            r = answer["response"]
            assert r.status_code in (200, 503), r.text
            # The model loads over the node left and serves.
            deadline = time.monotonic() + 90
            while True:
                r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                    "model": "side", "prompt": [1, 2, 3], "max_tokens": 4})
                if r.status_code == 200:
                    break
                assert time.monotonic() < deadline, r.text
                time.sleep(1)
            log = server.log_path.read_text()
            assert "were lost while it loaded" in log
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
