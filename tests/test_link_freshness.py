"""When a link measured at join is measured again (omlx_coordinator/nodes/link_freshness.py):
only while the cluster is quiet, only readings grown old, the links a plan uses first, and a
failed probe keeps the last good reading."""

from __future__ import annotations

from omlx_coordinator.nodes.link_freshness import (
    FreshnessPolicy,
    LinkAge,
    due,
    kept,
    may_probe,
    next_pair,
    quiet_since,
)
from omlx_shared.link_probe import LinkMeasurement

POLICY = FreshnessPolicy(max_age_s=600, quiet_s=10, retry_s=120)
GOOD = LinkMeasurement(gb_per_s=9.7, latency_us=18, nbytes=8 << 20)


def pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def measured(at: float) -> LinkAge:
    return LinkAge(tried_at=at, measured_at=at, measured_unix=1.7e9 + at)


def test_a_probe_waits_for_the_quiet_to_last():
    since = None
    for now, busy in ((0, True), (1, False), (5, False)):
        since = quiet_since(busy, since, now)
    assert since == 1 and not may_probe(since, 5, POLICY)  # quiet for 4 s of the 10
    assert may_probe(since, 11, POLICY)
    # A request in flight ends the quiet; the next one starts from scratch.
    since = quiet_since(True, since, 12)
    assert since is None and not may_probe(since, 100, POLICY)
    since = quiet_since(False, since, 100)
    assert not may_probe(since, 109.9, POLICY) and may_probe(since, 110, POLICY)
    # Re-measuring switched off (--link-max-age 0, or --no-link-probe): never.
    assert not may_probe(0.0, 1e9, FreshnessPolicy(max_age_s=0))


def test_a_reading_is_due_once_old_and_a_failure_waits_before_the_next_try():
    assert not due(measured(0), 599, POLICY) and due(measured(0), 600, POLICY)
    # An old reading whose re-probe failed just now: kept, and not tried again at once.
    failed = LinkAge(tried_at=700, measured_at=0)
    assert not due(failed, 819, POLICY) and due(failed, 820, POLICY)
    # Never measured (the probe at join failed): tried again after the retry wait only.
    assert not due(LinkAge(tried_at=0), 119, POLICY) and due(LinkAge(tried_at=0), 120, POLICY)
    assert not due(measured(0), 1e9, FreshnessPolicy(max_age_s=0))
    # A max age under the retry wait bounds the wait too.
    short = FreshnessPolicy(max_age_s=2, quiet_s=1, retry_s=120)
    assert not due(LinkAge(tried_at=0), 1.9, short) and due(LinkAge(tried_at=0), 2, short)


def test_the_links_a_plan_uses_go_first_then_the_oldest():
    ring = ["a", "b", "c", "d"]  # a plan's ring: a-b, b-c, c-d, d-a
    ages = {pair("a", "c"): measured(0),  # the oldest, but no plan sends over it
            pair("b", "c"): measured(100), pair("c", "d"): measured(50),
            pair("a", "b"): measured(990)}  # fresh
    assert next_pair(ring, ages, 1000, POLICY) == pair("c", "d")
    ages[pair("c", "d")] = measured(1000)
    assert next_pair(ring, ages, 1000, POLICY) == pair("b", "c")
    ages[pair("b", "c")] = measured(1000)
    assert next_pair(ring, ages, 1000, POLICY) == pair("a", "c")
    ages[pair("a", "c")] = measured(1000)
    assert next_pair(ring, ages, 1000, POLICY) is None  # everything fresh: nothing to do


def test_only_live_members_measured_at_a_join_are_probed():
    ages = {pair("a", "b"): measured(0), pair("b", "lost"): measured(0)}
    assert next_pair(["a", "b"], ages, 1000, POLICY) == pair("a", "b")
    assert next_pair(["b"], ages, 1000, POLICY) is None  # its peer is not live
    # Local nodes never probed (no reading of theirs at all) are left to what plans assume.
    assert next_pair(["local0", "local1"], {}, 1000, POLICY) is None


def test_a_failed_probe_keeps_the_last_good_reading():
    assert kept(GOOD, "not measured: b: busy") == GOOD
    assert kept(None, "not measured: b: busy") == "not measured: b: busy"
    assert kept("not measured: old", "not measured: new") == "not measured: new"
    newer = LinkMeasurement(gb_per_s=1.0, latency_us=300, nbytes=8 << 20)
    assert kept(GOOD, newer) == newer
