"""A joining node's links, measured: to every other live member over the data plane (both
agents run `doctor`'s link probe at once, omlx_shared/link_probe.py, each listening on its data
port), and to the coordinator over the control plane (the fastest of a few Health round
trips).

The planner counts the data-plane links (omlx_coordinator/planning/links.py); the control-plane
round trip is shown in status only (a plan's tokens cross it once a step, its tensors never).
Pairs are measured one at a time: a node in two probes at once would share its link between
them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

import grpc

from omlx_coordinator.nodes.node_client import AgentClient
from omlx_shared.link_probe import LinkMeasurement
from omlx_shared.outsider_logs import cut

log = logging.getLogger(__name__)

PROBE_TIMEOUT_SECONDS = 10.0  # each rank's wait for its peer (a firewall drops the connection)
CONTROL_PINGS = 5


class Member(Protocol):
    """What a survey reads and records of a member (cluster.py's Member)."""

    name: str
    agent: AgentClient
    links: dict[str, LinkMeasurement | str]
    control_rtt_ms: float


def _host(member: Member) -> str:
    return member.agent.address.rsplit(":", 1)[0]


async def probe_pair(a: Member, b: Member,
                     timeout: float = PROBE_TIMEOUT_SECONDS) -> LinkMeasurement:
    """The link between `a` (rank 0, which measures) and `b`; raises RuntimeError saying why
    it could not be measured."""
    try:
        ha, hb = await asyncio.gather(a.agent.health(), b.agent.health())
    except grpc.aio.AioRpcError as e:
        raise RuntimeError(f"no health: {e.details()}") from None
    peers = [f"{_host(a)}:{ha.data_port}", f"{_host(b)}:{hb.data_port}"]
    # Both ranks must run at once; both answers are awaited, so that neither agent is still
    # probing when the next pair starts.
    first, second = await asyncio.gather(a.agent.probe_link(0, peers, timeout),
                                         b.agent.probe_link(1, peers, timeout),
                                         return_exceptions=True)
    for who, result in ((a, first), (b, second)):
        if isinstance(result, grpc.aio.AioRpcError):
            raise RuntimeError(f"{who.name}: {result.details()}")
        if isinstance(result, BaseException):
            raise result
    return LinkMeasurement(gb_per_s=first.gb_per_s, latency_us=first.latency_us,
                           nbytes=first.nbytes)


async def control_rtt_ms(member: Member) -> float:
    """The fastest of a few Health round trips to `member`'s agent, in ms (0: no answer)."""
    best = 0.0
    for _ in range(CONTROL_PINGS):
        start = time.perf_counter()
        try:
            await member.agent.health()
        except grpc.aio.AioRpcError:
            continue
        took = (time.perf_counter() - start) * 1e3
        best = min(best, took) if best else took
    return best


async def survey(newcomer: Member, others: list[Member]) -> None:
    """Measures `newcomer`'s links to each of `others` (not measured yet) and to the
    coordinator; records each link, or why it could not be measured, on both members."""
    newcomer.control_rtt_ms = await control_rtt_ms(newcomer)
    for other in others:
        if isinstance(newcomer.links.get(other.name), LinkMeasurement):
            continue  # measured by the other's survey, since this one joined
        try:
            found: LinkMeasurement | str = await probe_pair(other, newcomer)
            log.info("link %s <-> %s: %.2f GB/s, %.0f us", other.name, newcomer.name,
                     found.gb_per_s, found.latency_us)
        except (RuntimeError, grpc.aio.AioRpcError) as e:
            found = f"not measured: {e}"
            log.warning("link %s <-> %s %s", other.name, newcomer.name, cut(found))
        newcomer.links[other.name] = other.links[newcomer.name] = found
