"""When a link measured at join is measured again: the pure decision, no I/O.

A link is measured when a node joins (link_survey.py), and a reading taken then, under a load
or a transfer, would otherwise stand until the node joins again: every later plan counts it. So
a reading older than `max_age_s` is taken again, but only while the cluster has been quiet (no
request in flight, no load) for `quiet_s`: a probe fills the link it measures, and must neither
slow a user's stream nor be slowed by one (a reading under load is what this replaces). One pair
is probed at a time, and the quiet is checked again before each. The links a plan would use
(each live member's to the next, the ring the planner reads) go first, the oldest of the rest
after. A probe that fails keeps the last good reading, and the pair waits `retry_s` (or
`max_age_s`, if shorter) before it is tried again, so a firewalled pair is not probed at every
quiet moment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from omlx_shared.link_probe import LinkMeasurement

DEFAULT_MAX_AGE_SECONDS = 600.0


@dataclass(frozen=True)
class FreshnessPolicy:
    max_age_s: float = DEFAULT_MAX_AGE_SECONDS  # 0: a reading stands until the next join
    quiet_s: float = 10.0  # how long nothing ran before a probe may start
    # After a probe of a pair, good or not, the least wait to the next (at most max_age_s).
    retry_s: float = 120.0

    @property
    def enabled(self) -> bool:
        return self.max_age_s > 0


@dataclass
class LinkAge:
    """One link's readings, shared by both of its members' records (the link is symmetric)."""

    tried_at: float  # monotonic time of the last probe, good or not
    measured_at: float | None = None  # ... of the last good reading (None: none yet)
    measured_unix: float | None = None  # the same as wall-clock time, for status


def quiet_since(busy: bool, since: float | None, now: float) -> float | None:
    """When the cluster's current quiet began (`since` carried over), None while it is busy."""
    if busy:
        return None
    return now if since is None else since


def may_probe(since: float | None, now: float, policy: FreshnessPolicy) -> bool:
    """Whether the cluster has been quiet long enough for a probe to start now."""
    return policy.enabled and since is not None and now - since >= policy.quiet_s


def due(age: LinkAge, now: float, policy: FreshnessPolicy) -> bool:
    """Whether this link's reading is old enough (or missing) and its last try long enough ago."""
    stale = age.measured_at is None or now - age.measured_at >= policy.max_age_s
    return policy.enabled and stale and now - age.tried_at >= min(policy.retry_s,
                                                                   policy.max_age_s)


def next_pair(ring: Sequence[str], ages: Mapping[frozenset[str], LinkAge], now: float,
              policy: FreshnessPolicy) -> frozenset[str] | None:
    """The pair of `ring`'s members (live, in the order plans take them) to probe now, or None.
    Only pairs measured at a join are taken (`ages`): nodes that were never probed (a serve's
    local ones, --no-link-probe) keep what plans assume. Ring neighbours first (the links a
    plan counts), then the oldest reading (never measured counts as oldest)."""
    live = set(ring)
    used = {frozenset((a, ring[(i + 1) % len(ring)])) for i, a in enumerate(ring)
            if len(ring) > 1}
    candidates = [(pair not in used, age.measured_at or float("-inf"), sorted(pair), pair)
                  for pair, age in ages.items() if pair <= live and due(age, now, policy)]
    return min(candidates, key=lambda c: c[:3])[3] if candidates else None


def kept(old: LinkMeasurement | str | None, found: LinkMeasurement | str
         ) -> LinkMeasurement | str:
    """What a link's record holds after a probe that `found` a reading or why there is none:
    a failure keeps the last good reading (a node busy for a moment has not lost its link)."""
    if isinstance(found, str) and isinstance(old, LinkMeasurement):
        return old
    return found
