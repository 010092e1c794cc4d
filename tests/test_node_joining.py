"""A node admitted while its links are still being measured is not a member plans may use, nor
one a restarted coordinator counts back: a plan loading on it raced the link probes for its
data port, and the pipeline never linked (the soak's restart that took 82 s)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omlx_coordinator.nodes.cluster import Cluster, ClusterOptions
from tests.cluster_secret import SECRET
from tests.helpers.weights import agent_process

pytestmark = pytest.mark.slow


def test_a_node_is_planned_and_counted_back_only_once_its_links_are_measured(tmp_path):
    with agent_process(tmp_path / "a", "mac-a") as (a_proc, a_address), \
            agent_process(tmp_path / "b", "mac-b") as (_, b_address):
        async def main() -> tuple[list[str], set[str], list[str], set[str]]:
            cluster = Cluster(ClusterOptions(nodes=0, secret=SECRET))
            await cluster.start()
            try:
                await cluster.add_remote(a_address, "mac-a")
                cluster.expected = {"mac-b"}  # as after a restart, b not back yet
                # a does not answer: b's survey (its link to a) lasts until a's Health call
                # gives up, and b is admitted meanwhile.
                os.kill(a_proc.pid, signal.SIGSTOP)
                try:
                    joining = asyncio.ensure_future(cluster.add_remote(b_address, "mac-b"))
                    for _ in range(200):
                        if any(m.name == "mac-b" for m in cluster.members) or joining.done():
                            break
                        await asyncio.sleep(0.02)
                    assert not joining.done(), "b's survey ended before it could be seen"
                    during = ([m.name for m in cluster.servable()], set(cluster.expected))
                    await asyncio.wait_for(joining, 60)
                finally:
                    os.kill(a_proc.pid, signal.SIGCONT)
                after = ([m.name for m in cluster.servable()], set(cluster.expected))
                return (*during, *after)
            finally:
                await cluster.stop()

        servable_during, expected_during, servable_after, expected_after = asyncio.run(main())
    assert "mac-b" not in servable_during and expected_during == {"mac-b"}
    assert "mac-b" in servable_after and expected_after == set()
