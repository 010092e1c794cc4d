"""Priority classes: the gate's order and share (pure asyncio), and on a live server an
interactive request served ahead of a queue of batch streams that all still finish."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from omlx_coordinator.models import priority as prio
from omlx_coordinator.models.priority import BATCH, INTERACTIVE, PriorityGate
from tests.conftest import start_server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_batch_keeps_to_its_share_and_interactive_never_waits():
    async def main():
        gate = PriorityGate(slots=4, batch_share=0.5)
        order: list[str] = []

        async def request(name: str, cls: str, hold: asyncio.Event):
            await gate.enter(cls)
            order.append(name)
            await hold.wait()
            gate.leave(cls)

        hold = asyncio.Event()
        tasks = [asyncio.create_task(request(f"b{i}", BATCH, hold)) for i in range(6)]
        await asyncio.sleep(0.01)
        assert order == ["b0", "b1"]  # its share: 2 of 4 slots
        assert gate.running == {INTERACTIVE: 0, BATCH: 2}
        assert gate.waiting == {INTERACTIVE: 0, BATCH: 4}
        tasks += [asyncio.create_task(request(f"i{i}", INTERACTIVE, hold)) for i in range(3)]
        await asyncio.sleep(0.01)
        # Even past the slots: the node's queue is theirs.
        assert order == ["b0", "b1", "i0", "i1", "i2"]
        hold.set()
        await asyncio.gather(*tasks)
        assert order[5:] == ["b2", "b3", "b4", "b5"]
        assert gate.running == {INTERACTIVE: 0, BATCH: 0} and not gate._waiting

    run(main())


def test_a_cancelled_waiter_holds_nothing_and_batch_never_starves(monkeypatch):
    monkeypatch.setattr(prio, "BATCH_LONGEST_WAIT", 0.2)

    async def main():
        gate = PriorityGate(slots=2, batch_share=0.5)
        await gate.enter(BATCH)
        waiting = asyncio.create_task(gate.enter(BATCH))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert gate.waiting[BATCH] == 0 and gate.running[BATCH] == 1
        # Past its longest wait a batch request takes a free slot beyond its share.
        t0 = time.monotonic()
        await gate.enter(BATCH)
        assert 0.15 < time.monotonic() - t0 < 2 and gate.running[BATCH] == 2

    run(main())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        PriorityGate(0)
    with pytest.raises(ValueError):
        PriorityGate(4, batch_share=0)


BATCH_KEY, PERSON_KEY = "batch-agent-key", "person-key"
KEYS = f"""
[[key]]
name = "agents"
key = "{BATCH_KEY}"
priority = "batch"

[[key]]
name = "person"
key = "{PERSON_KEY}"
"""


def first_token_at(url: str, model: str, key: str, max_tokens: int, out: dict, name: str):
    with httpx.stream("POST", url + "/v1/completions", timeout=300,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": "Once upon a time", "stream": True,
                            "max_tokens": max_tokens, "ignore_eos": True,
                            "temperature": 0}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and name not in out:
                out[name] = time.monotonic()
    out[name + " done"] = True


@pytest.mark.slow
def test_an_interactive_request_is_served_ahead_of_queued_batch_streams(tiny_model_path,
                                                                       tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with start_server(tiny_model_path, "--max-batch", "4", "--keys-file", str(keys),
                      home=tmp_path / "h", keepalive=None) as server:
        out: dict = {}
        threads = [threading.Thread(target=first_token_at, args=(
            server.url, server.model_id, BATCH_KEY, 400, out, f"batch{i}")) for i in range(12)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(k.startswith("batch") for k in out) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        metrics = server.metrics()
        assert metrics['omlx_model_slots_running{class="batch"}'] == 2
        assert metrics['omlx_model_slots_waiting{class="batch"}'] == 10
        first_token_at(server.url, server.model_id, PERSON_KEY, 8, out, "person")
        waited = [out.get(f"batch{i}") for i in range(12)]
        # It came in after two batch streams started and before any queued one did.
        assert sum(t is not None and t < out["person"] for t in waited) == 2
        for t in threads:
            t.join(300)
        assert all(out.get(f"batch{i} done") for i in range(12))
