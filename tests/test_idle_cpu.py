"""An idle cluster idles: with no request in flight, no process of a 2-node `serve` (gateway,
node agents, shard workers, standby workers) burns CPU, and the first request after idling is
answered as before. MLX's ring backend spins a core while a receive is posted, so the stages
after the head must sleep while the pipeline idles (omlx_node/wire.py's doorbell)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, descendants, start_server

pytestmark = pytest.mark.slow

# A spinning stage shows ~100% of a core; an idle process a fraction of 1%. The bound leaves
# room for a loaded 2-core machine, where even a sleeping process's wake-ups cost more.
MAX_IDLE_SHARE = 0.10
WINDOW_SECONDS = 3.0
# Processes that start after the plan's workers (the agents' next standby workers import MLX)
# may still be busy when the server turns healthy: give them this long to settle.
SETTLE_SECONDS = 60.0
TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a live process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may contain spaces
    return int(fields[11]) + int(fields[12])


def cpu_shares(pids: set[int], seconds: float) -> dict[int, float]:
    """The share of one core each of `pids` used over the next `seconds` (those alive at both
    ends)."""
    before = {p: cpu_ticks(p) for p in pids}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {p: cpu_ticks(p) for p in pids}
    span = time.monotonic() - t0
    return {p: (after[p] - before[p]) / TICK / span for p in pids
            if before[p] is not None and after[p] is not None}


def settled_shares(server: Server) -> dict[int, float]:
    """Every process of `server` over one window; the first window where all of them are under
    MAX_IDLE_SHARE, else the last one measured within SETTLE_SECONDS."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        shares = cpu_shares({server.proc.pid} | descendants(server.proc.pid), WINDOW_SECONDS)
        if max(shares.values()) < MAX_IDLE_SHARE or time.monotonic() > deadline:
            return shares


def describe(shares: dict[int, float]) -> str:
    def command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            return "(gone)"

    return "\n".join(f"{p}: {s:.1%} {command(p)}" for p, s in sorted(shares.items()))


def complete(server: Server) -> str:
    """A greedy completion of a fixed prompt, every token of it."""
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model_id, "prompt": [5, 6, 7, 8, 9], "max_tokens": 12,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 12
    return choice["text"]


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_an_idle_two_node_serve_uses_no_cpu_and_answers_as_before(model, tmp_path, parallel):
    """A pipeline's stages, or a tensor-parallel stage's ranks, sleep on their doorbells."""
    with start_server(model, "--nodes", "2", "--parallel", parallel, home=tmp_path / "h",
                      keepalive=None) as server:
        nodes = httpx.get(server.url + "/health", timeout=10).json()["nodes"]
        workers = {n["worker_pid"] for n in nodes}
        assert len(workers) == 2 and None not in workers
        before = complete(server)  # the head's loop is measured after a request, too

        shares = settled_shares(server)
        assert workers <= shares.keys(), describe(shares)
        assert max(shares.values()) < MAX_IDLE_SHARE, describe(shares)

        assert complete(server) == before
