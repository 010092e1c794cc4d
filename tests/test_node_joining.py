"""A node admitted while its links are still being measured is not a member plans may use, nor
one a restarted coordinator counts back: a plan loading on it raced the link probes for its
data port, and the pipeline never linked (the soak's restart that took 82 s). A restarted
coordinator whose probe of a link finds nothing keeps the reading it took before the restart:
without it the planner would count the link as free and plan otherwise than before."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from omlx_coordinator.nodes.cluster import Cluster, ClusterOptions
from omlx_coordinator.nodes.known_nodes import FILE_NAME, KnownNodes
from omlx_shared.link_probe import LinkMeasurement
from omlx_shared.model_store import data_home
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


def test_a_restarted_coordinator_keeps_a_link_it_cannot_probe_again(tmp_path):
    before = LinkMeasurement(gb_per_s=1.5, latency_us=29.0, nbytes=1 << 24)
    known = KnownNodes(data_home() / FILE_NAME)
    known.save({"mac-a", "mac-b"}, {frozenset({"mac-a", "mac-b"}): before})
    try:
        with agent_process(tmp_path / "a", "mac-a") as (a_proc, a_address), \
                agent_process(tmp_path / "b", "mac-b") as (_, b_address):
            async def main() -> dict:
                cluster = Cluster(ClusterOptions(nodes=0, secret=SECRET))
                await cluster.start()  # as after a restart: it reads what it wrote before
                try:
                    await cluster.add_remote(a_address, "mac-a")
                    os.kill(a_proc.pid, signal.SIGSTOP)  # b's probe of its link to a: nothing
                    try:
                        await asyncio.wait_for(cluster.add_remote(b_address, "mac-b"), 60)
                    finally:
                        os.kill(a_proc.pid, signal.SIGCONT)
                    return dict(cluster.measured_links())
                finally:
                    await cluster.stop()

            links = asyncio.run(main())
        assert links == {frozenset({"mac-a", "mac-b"}): before}
        assert known.load_links() == links  # written down again for the next restart
    finally:  # the session's home is shared: no other test's coordinator waits for these
        known.path.unlink(missing_ok=True)
