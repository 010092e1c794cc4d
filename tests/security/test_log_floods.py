"""Issue 49, part 4: an outsider cannot flood the coordinator's log. What it sends is cut before
it is logged, and its refusals collapse into a line a minute (omlx_shared/outsider_logs.py)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_shared import auth
from omlx_shared.outsider_logs import CUT_CHARS, Refusals, cut
from tests.cluster_secret import SECRET
from tests.tiny_models import build_model, serving

LONGEST_LINE = 3 * CUT_CHARS + 200  # three cut values and the words around them


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def refusals(caplog):
    clock = Clock()
    caplog.set_level(logging.WARNING, logger="test.refusals")
    return Refusals(logging.getLogger("test.refusals"), interval=60, max_sources=4,
                    clock=clock), clock


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.refusals"]


def test_cut_keeps_short_values_and_cuts_long_ones_to_one_line():
    assert cut("10.0.0.5:50051") == "10.0.0.5:50051"
    long = cut("x" * (1 << 20))
    assert len(long) < CUT_CHARS + 40 and long.endswith(f"({1 << 20} characters)")
    forged = cut("mac-a\n2026-01-01 00:00:00 INFO omlx: admitted\x1b[2J")
    assert "\n" not in forged and "\x1b" not in forged and "\\n2026" in forged
    assert len(cut("\x00" * CUT_CHARS)) < CUT_CHARS + 40  # escaping does not lengthen it
    assert cut(ValueError("bad")) == "bad"


def test_one_line_a_minute_per_source_with_the_count(refusals, caplog):
    log, clock = refusals
    for _ in range(1000):
        log.warning("10.0.0.9", "registration", "refused %s", "10.0.0.9")
        clock.now += 0.001
    assert lines(caplog) == ["refused 10.0.0.9"]
    clock.now += 60
    log.warning("10.0.0.9", "registration", "refused %s", "10.0.0.9")
    assert lines(caplog)[1] == "refused 10.0.0.9 (and 999 more from 10.0.0.9 in the last minute)"


def test_a_source_that_stopped_is_counted_on_the_next_line_of_another(refusals, caplog):
    log, clock = refusals
    for _ in range(3):
        log.warning("10.0.0.9", "registration", "refused a")
    clock.now += 61
    log.warning("10.0.0.7", "registration", "refused b")
    assert lines(caplog) == ["refused a", "2 more refusals (registration) from 10.0.0.9 in the "
                                          "last minute", "refused b"]


def test_reasons_are_apart_and_sources_past_the_bound_share_a_line(refusals, caplog):
    log, clock = refusals
    log.warning("10.0.0.1", "registration", "r")
    log.warning("10.0.0.1", "admission", "a")  # another reason: its own line
    for i in range(1000):  # an attacker with many addresses
        log.warning(f"10.1.{i // 256}.{i % 256}", "registration", "r %s", i)
    assert lines(caplog) == ["r", "a", "r 0", "r 1", "r 2"]  # four pairs, then the crowd's
    assert len(log._windows) == 5  # the bound, and the one shared by the rest


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("floods") / "tiny-floods", "llama",
                       num_layers=2)


def post_registrations(model, bodies: list[bytes]) -> list[int]:
    """Posts each body to a coordinator's /cluster/register (the app in-process); the
    statuses."""
    async def scenario() -> list[int]:
        manager = serving(model, "tiny-floods", ClusterOptions(nodes=0, secret=SECRET,
                                                               os_reserve_bytes=0))
        app = create_app(manager, start_cluster=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return [(await http.post("/cluster/register", content=body,
                                     headers={"content-type": "application/json"})).status_code
                    for body in bodies]

    return asyncio.run(scenario())


def coordinator_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("omlx_coordinator")]


def test_a_1mib_registration_logs_a_short_line(model, caplog):
    huge = "A" * (1 << 20) + ":50051"
    body = httpx.Request("POST", "/", json=auth.registration("a guess at the secret", huge,
                                                             "mac-" + "b" * (1 << 10))).content
    with caplog.at_level(logging.INFO, logger="omlx_coordinator"):
        assert post_registrations(model, [body]) == [401]
    said = [m for m in coordinator_lines(caplog) if "refused a registration" in m]
    assert len(said) == 1 and len(said[0]) < LONGEST_LINE, said[0][:500]
    assert f"({len(huge)} characters)" in said[0]


def test_a_thousand_bad_registrations_add_a_line(model, caplog):
    forged = [httpx.Request("POST", "/", json=auth.registration(
        "a guess at the secret", f"10.0.0.{i % 250}:50051", f"mac-{i}")).content
        for i in range(1000)]
    with caplog.at_level(logging.INFO, logger="omlx_coordinator"):
        statuses = post_registrations(model, forged)
    assert statuses == [401] * 1000
    said = coordinator_lines(caplog)
    assert len(said) <= 3, said
