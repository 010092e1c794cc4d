"""The coordinator's heartbeat when the coordinator itself stalls (CPU-bound work on its event
loop, or the whole machine starved, as under a heavy load): the stall is its own silence, not
the node's, and loses nobody; a node that really stops answering is still lost within the
stated budget however much the coordinator stalls."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from omlx_coordinator.nodes.cluster import (
    HEARTBEAT_SECONDS,
    NODE_LOST_SECONDS,
    STALL_BUDGET_SECONDS,
    Cluster,
    ClusterOptions,
)
from tests.cluster_secret import SECRET
from tests.helpers.weights import agent_process

pytestmark = pytest.mark.slow

STALL = NODE_LOST_SECONDS + 0.5  # longer than a node may be silent
LATE = 1.5  # the node answers again this long after the coordinator (longer than a deadline)


def test_a_stalled_coordinator_loses_no_node_and_a_stopped_one_within_budget(tmp_path):
    with agent_process(tmp_path / "a", "mac-a") as (proc, address):
        async def main() -> tuple[bool, float | None]:
            cluster = Cluster(ClusterOptions(nodes=0, secret=SECRET))
            await cluster.start()
            try:
                member = await cluster.add_remote(address, "mac-a")
                await asyncio.sleep(4 * HEARTBEAT_SECONDS)

                # The machine stalls, coordinator and node alike; the node resumes a little
                # after the coordinator (the soak's "node b lost" with no fault injected).
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    time.sleep(STALL)  # the loop runs nothing meanwhile
                    await asyncio.sleep(LATE)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                await asyncio.sleep(4 * HEARTBEAT_SECONDS)
                kept = member.alive

                # Stopped while the coordinator stalls again and again: lost all the same.
                os.kill(proc.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    while member.alive and time.monotonic() - stopped < 3 * STALL_BUDGET_SECONDS:
                        time.sleep(STALL)
                        await asyncio.sleep(2 * HEARTBEAT_SECONDS)
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                return kept, (time.monotonic() - stopped if not member.alive else None)
            finally:
                await cluster.stop()

        kept, lost_after = asyncio.run(main())
    assert kept, "a node lost for the coordinator's own stall"
    assert lost_after is not None, "a stopped node was never lost while the coordinator stalled"
    # Noticed at the first beat past the budget: at most one more stall and a beat later.
    assert lost_after < NODE_LOST_SECONDS + STALL_BUDGET_SECONDS + STALL + 4 * HEARTBEAT_SECONDS
