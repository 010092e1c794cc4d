"""A joining node's links, measured: to every other live member over the data plane (both
agents run `doctor`'s link probe at once, omlx_shared/link_probe.py, each listening on its data
port), and to the coordinator over the control plane (the fastest of a few Health round
trips).

The planner counts the data-plane links (omlx_coordinator/planning/links.py); the control-plane
round trip is shown in status only (a plan's tokens cross it once a step, its tensors never).
Pairs are measured one at a time: a node in two probes at once would share its link between
them. Later, while the cluster is quiet, `keep_fresh` measures again the links whose reading
has grown old (when and which: link_freshness.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from omlx_coordinator.nodes.link_freshness import (
    FreshnessPolicy,
    LinkAge,
    kept,
    may_probe,
    next_pair,
    quiet_since,
)
from omlx_coordinator.nodes.node_client import AgentClient
from omlx_shared.link_probe import LinkMeasurement
from omlx_shared.outsider_logs import cut

log = logging.getLogger(__name__)

PROBE_TIMEOUT_SECONDS = 10.0  # each rank's wait for its peer (a firewall drops the connection)
CONTROL_PINGS = 5
CHECK_SECONDS = 2.0  # how often keep_fresh looks for a quiet cluster and an old reading


class Member(Protocol):
    """What a survey reads and records of a member (cluster.py's Member)."""

    name: str
    agent: AgentClient
    links: dict[str, LinkMeasurement | str]
    link_ages: dict[str, LinkAge]
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


async def measure(a: Member, b: Member) -> None:
    """Probes the link between `a` (rank 0) and `b` and records on both what it found: a
    reading, or why there is none (which keeps a good reading taken before: `kept`)."""
    age = a.link_ages.get(b.name) or LinkAge(tried_at=0.0)
    age.tried_at = time.monotonic()
    try:
        found: LinkMeasurement | str = await probe_pair(a, b)
        age.measured_at, age.measured_unix = time.monotonic(), time.time()
        log.info("link %s <-> %s: %.2f GB/s, %.0f us", a.name, b.name, found.gb_per_s,
                 found.latency_us)
    except (RuntimeError, grpc.aio.AioRpcError) as e:
        found = f"not measured: {e}"
        log.warning("link %s <-> %s %s", a.name, b.name, cut(found))
    a.links[b.name] = b.links[a.name] = kept(a.links.get(b.name), found)
    a.link_ages[b.name] = b.link_ages[a.name] = age


async def survey(newcomer: Member, others: list[Member]) -> None:
    """Measures `newcomer`'s links to each of `others` (not measured yet) and to the
    coordinator; records each link, or why it could not be measured, on both members."""
    newcomer.control_rtt_ms = await control_rtt_ms(newcomer)
    for other in others:
        if isinstance(newcomer.links.get(other.name), LinkMeasurement):
            continue  # measured by the other's survey, since this one joined
        await measure(other, newcomer)


async def keep_fresh(ring: Callable[[], list[Member]], busy: Callable[[], bool],
                     probing: asyncio.Lock, policy: FreshnessPolicy,
                     every: float = CHECK_SECONDS) -> None:
    """Until cancelled: every `every` seconds, once `busy()` has been false for the policy's
    quiet time, measures again the one link of `ring()` (the live members, in plan order) that
    next_pair picks, under `probing` (the lock surveys hold: one probe at a time)."""
    since: float | None = None
    while True:
        await asyncio.sleep(every)
        now = time.monotonic()
        since = quiet_since(busy(), since, now)
        if not may_probe(since, now, policy):
            continue
        members = {m.name: m for m in ring()}
        ages = {frozenset((m.name, peer)): age for m in members.values()
                for peer, age in m.link_ages.items()}
        pair = next_pair(list(members), ages, now, policy)
        if pair is None:
            continue
        async with probing:
            if busy():  # a request came while a survey held the lock
                since = None
                continue
            a, b = (members[n] for n in sorted(pair))
            try:
                await measure(a, b)
            except Exception:  # the next reading is worth trying all the same
                log.warning("link %s <-> %s: the probe failed", a.name, b.name, exc_info=True)
