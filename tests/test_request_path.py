"""The request path without processes: the retry rules as the pure functions they are, and
generate() through a RequestLease against replicas whose head workers follow a script
(tests/helpers/fake_replica.py): chunks, clean stops for a new plan, a worker dying under the
request, drains and a second replica. Each rule in milliseconds; what a real worker's death does
end to end stays in tests/test_failure_paths.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from omlx_coordinator.errors import APIError
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.nodes.worker_session import rpc_error
from omlx_coordinator.request import request_lease
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.request.generation import GatewaySettings, GenerationRequest, generate
from omlx_coordinator.request.retry import (
    MAX_ATTEMPTS,
    RETRIABLE,
    Fail,
    Lost,
    Resume,
    RetryState,
    lost_by,
)
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_shared.block_hashes import block_hashes
from tests.helpers.fake_replica import (
    FakeWorker,
    aborted,
    add_replica,
    broken,
    chunk,
    fake_manager,
    serve,
)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
SETTINGS = GatewaySettings(keepalive_seconds=0.02, request_timeout=5.0)


# ---- the rules ---------------------------------------------------------------------------------

A, B = SimpleNamespace(name="m"), SimpleNamespace(name="m#1")  # two replicas
BROKE, STOPPED = Lost("UNAVAILABLE: gone", broke=True), Lost("shutting down", broke=False)


def test_how_an_attempt_is_lost() -> None:
    for code in RETRIABLE:
        assert lost_by(rpc_error(code, "x")) == Lost(f"{code.name}: x", True)
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED):
        assert lost_by(rpc_error(code, "x")) is None  # the request's answer, not a lost node
    assert lost_by(aborted()) == Lost("the node is shutting down", False)
    assert lost_by(chunk(finish="aborted")) == Lost("the worker shut down", False)
    for ending in ("", "stop", "length", "error", "cancelled"):
        assert lost_by(chunk(1, finish=ending, error="e")) is None


def test_a_clean_stop_always_resumes_until_the_attempts_run_out() -> None:
    retry = RetryState()
    for epoch in range(1, MAX_ATTEMPTS):
        assert retry.on_lost((A, epoch), STOPPED) == Resume((A, epoch))
        assert retry.avoid == (A, epoch)
    step = retry.on_lost((A, MAX_ATTEMPTS), STOPPED)
    assert isinstance(step, Fail) and step.error.status == 503
    assert step.error.message == f"lost the node {MAX_ATTEMPTS} times; last: shutting down"


def test_breaking_a_second_plan_fails_with_the_requests_own_error() -> None:
    retry = RetryState()
    assert retry.on_lost((A, 1), BROKE) == Resume((A, 1))
    assert retry.on_lost((A, 2), STOPPED) == Resume((A, 2))  # a clean stop is never its fault
    step = retry.on_lost((A, 3), BROKE)
    assert isinstance(step, Fail) and step.error.status == 500
    assert step.error.code == "request_failed_node"
    assert step.error.message == ("the node went down under this request on two plans, so it "
                                  "is not run again; last: UNAVAILABLE: gone")
    assert step.log == ("a request broke plan 3 of m after plan 1 of m; it is not run again: "
                        "UNAVAILABLE: gone")


def test_breaking_the_same_plan_again_is_not_a_second_plan() -> None:
    """A request tried again on the plan it lost (its new plan did not come in time) may break
    it again: that plan was down already, not brought down again."""
    retry = RetryState()
    assert retry.on_lost((A, 1), BROKE) == Resume((A, 1))
    assert retry.on_lost((A, 1), BROKE) == Resume((A, 1))
    assert isinstance(retry.on_lost((B, 1), BROKE), Fail)  # another replica is another plan


# ---- generate() through a lease, on scripted replicas -----------------------------------------

@pytest.fixture
def manager(model) -> ModelManager:
    return fake_manager(model)


def request(max_tokens: int = 6, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=list(PROMPT), max_tokens=max_tokens, temperature=0.0,
                             ignore_eos=True, **kw)


async def drive(manager: ModelManager, req: GenerationRequest, settings=SETTINGS,
                until: int | None = None) -> tuple[list, Done | APIError | None]:
    """The request's events and how it ended (None: closed by its client after `until`
    events, as a client that goes away)."""
    events: list = []
    stream = generate(manager, manager.models[0], GatewayMetrics(), settings, req)
    try:
        async for ev in stream:
            events.append(ev)
            if isinstance(ev, Done):
                return events, ev
            if until is not None and len(events) >= until:
                await stream.aclose()
                return events, None
    except APIError as e:
        return events, e
    raise AssertionError("the generation ended without Done")


def tokens_of(events: list) -> list[int]:
    return [t for ev in events if isinstance(ev, Delta) for t in ev.tokens]


def assert_let_go(manager: ModelManager) -> None:
    """Whatever happened, the request holds nothing any more."""
    model = manager.models[0]
    assert model.leases == 0
    assert all(d.inflight == 0 for d in manager.replicas[model.name])
    assert model.gate.running == {"interactive": 0, "batch": 0}


def cached(manager: ModelManager, d, tokens: list[int]) -> int:
    """How many blocks of `tokens` `d`'s prefix index holds."""
    return d.prefixes.matched(block_hashes(d.model.name, tokens, manager.block_size))


def test_a_request_runs_to_its_end_and_lets_go(manager) -> None:
    d = manager.main
    worker = FakeWorker([chunk(1, 2, cached=4), chunk(3), chunk(4, 5, 6, finish="length")])
    serve(d, worker)

    events, done = asyncio.run(drive(manager, request()))
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (8, 6, 4)
    assert tokens_of(events) == [1, 2, 3, 4, 5, 6]
    assert list(worker.requests[0].prompt_tokens) == PROMPT
    assert d.requests == 1
    assert_let_go(manager)
    assert cached(manager, d, PROMPT + [1, 2, 3, 4, 5, 6]) == 3  # a follow-up turn comes here


def test_a_clean_stop_resumes_on_the_new_plan_from_where_it_was(manager) -> None:
    d = manager.main
    worker = FakeWorker()
    replan = serve(d, worker)
    worker.script.extend([[chunk(1, 2), replan, aborted()],
                          [chunk(3, cached=9), chunk(4, finish="length")]])

    events, done = asyncio.run(drive(manager, request(4)))
    assert tokens_of(events) == [1, 2, 3, 4] and done.completion_tokens == 4
    resumed = worker.requests[1]
    assert list(resumed.prompt_tokens) == PROMPT + [1, 2]
    assert (resumed.resumed_tokens, resumed.max_tokens) == (2, 2)
    assert done.cached_tokens == 0  # the resumed attempt's hit is of its own output
    assert worker.calls[0].cancelled and d.requests == 2 and d.epoch == 2
    assert_let_go(manager)


def test_a_request_that_breaks_two_plans_is_not_run_again(manager) -> None:
    d = manager.main
    worker = FakeWorker()
    replan = serve(d, worker)
    worker.script.extend([[chunk(1, 2, 3, 4), replan, broken()],
                          [chunk(5, 6, 7, 8), replan, broken()]])

    events, ended = asyncio.run(drive(manager, request(20)))
    assert isinstance(ended, APIError) and ended.code == "request_failed_node"
    assert tokens_of(events) == [1, 2, 3, 4, 5, 6, 7, 8] and len(worker.requests) == 2
    assert_let_go(manager)
    # What each attempt was sent is cached (it was prefilled), not what the lost one made.
    assert cached(manager, d, PROMPT + [1, 2, 3, 4, 5, 6, 7, 8]) == 3


def test_a_request_whose_plans_keep_changing_gives_up(manager) -> None:
    d = manager.main
    worker = FakeWorker()
    replan = serve(d, worker)
    worker.script.extend([[chunk(i), replan, aborted()] for i in range(MAX_ATTEMPTS)])

    events, ended = asyncio.run(drive(manager, request(100)))
    assert isinstance(ended, APIError) and ended.status == 503
    assert ended.message == (f"lost the node {MAX_ATTEMPTS} times; last: the node is shutting "
                             "down")
    assert tokens_of(events) == list(range(MAX_ATTEMPTS)) and d.requests == MAX_ATTEMPTS
    assert_let_go(manager)


def test_a_lost_plan_waits_for_its_new_plan_then_tries_the_same_one(manager, monkeypatch) -> None:
    """The node's loss is not seen yet: the request waits a little for the re-plan, then, with
    none, tries the plan it lost again."""
    monkeypatch.setattr(request_lease, "REPLAN_WAIT_SECONDS", 0.3)
    d = manager.main
    worker = FakeWorker()
    replan = serve(d, worker)

    async def late_replan() -> tuple[list, Done | APIError | None]:
        asyncio.get_running_loop().call_later(0.1, replan)
        return await drive(manager, request(2))

    worker.script.extend([[chunk(1), broken()], [chunk(2, finish="length")]])
    t0 = time.monotonic()
    events, done = asyncio.run(late_replan())
    assert isinstance(done, Done) and tokens_of(events) == [1, 2]
    assert 0.1 <= time.monotonic() - t0 < 0.3 and d.epoch == 2

    worker.script.extend([[chunk(1), broken()], [chunk(2), broken()], [chunk(3, finish="length")]])
    t0 = time.monotonic()
    events, done = asyncio.run(drive(manager, request(3)))
    # Twice on the plan it lost (each after the wait): the same plan broke, not a second one.
    assert isinstance(done, Done) and tokens_of(events) == [1, 2, 3] and d.epoch == 2
    assert time.monotonic() - t0 >= 0.6
    assert_let_go(manager)


def test_a_lost_replica_hands_the_request_to_another_at_once(manager) -> None:
    a, b = manager.main, add_replica(manager)
    out = list(range(1, 9))
    wa, wb = FakeWorker([chunk(*out), broken()]), FakeWorker([chunk(9, finish="length")])
    serve(a, wa)
    serve(b, wb)

    t0 = time.monotonic()
    events, done = asyncio.run(drive(manager, request(9)))
    assert isinstance(done, Done) and tokens_of(events) == out + [9]
    assert time.monotonic() - t0 < 0.2  # no wait for a's new plan
    assert list(wb.requests[0].prompt_tokens) == PROMPT + out
    assert (a.requests, b.requests) == (1, 1)
    assert_let_go(manager)
    # a was sent the prompt; what it generated before it broke is not in its cache.
    assert cached(manager, a, PROMPT + out) == 2 and cached(manager, b, PROMPT + out) == 4


def test_a_drain_holds_new_requests_not_one_resuming(manager) -> None:
    """A load that needs the model's memory drains it: a new request waits (keep-alives) for
    the drain to end, while one that holds its lease and lost its node goes on, since the drain
    waits for that lease."""
    d, model = manager.main, manager.models[0]
    worker = FakeWorker()
    replan = serve(d, worker)

    def drain_and_replan() -> None:
        manager.draining.add(model.name)
        replan()

    worker.script.extend([[chunk(1), drain_and_replan, aborted()], [chunk(2, finish="length")],
                          [chunk(7, finish="length")]])

    async def scenario():
        resumed = await drive(manager, request(2))
        held = asyncio.create_task(drive(manager, request(1)))
        await asyncio.sleep(0.2)
        waited = held.done()
        manager.draining.discard(model.name)
        return resumed, waited, await held

    (events, done), waited, (held_events, held_done) = asyncio.run(scenario())
    assert isinstance(done, Done) and tokens_of(events) == [1, 2]
    assert not waited and tokens_of(held_events) == [7]
    assert sum(isinstance(ev, KeepAlive) for ev in held_events) >= 3
    assert_let_go(manager)


def test_the_requests_own_failures_are_not_run_again(manager) -> None:
    d = manager.main
    worker = FakeWorker(
        [chunk(1), rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")],
        [chunk(1), chunk(finish="error", error="grammar: too wide")],
        [chunk(1), chunk(finish="cancelled")])
    serve(d, worker)

    ends = [asyncio.run(drive(manager, request()))[1] for _ in range(3)]
    assert [(e.status, e.message) for e in ends[:1]] == [(400, "max_tokens must be at least 1")]
    assert ends[1].status == 400 and ends[1].code == "grammar_failed"
    assert ends[2].status == 503 and ends[2].message == "the node cancelled this request"
    assert d.requests == 3 and not worker.script
    assert_let_go(manager)


def test_a_client_that_goes_away_frees_its_sequence_and_lease(manager) -> None:
    d = manager.main
    worker = FakeWorker([chunk(1), chunk(2), 1.0, chunk(3, finish="length")])
    serve(d, worker)

    events, end = asyncio.run(drive(manager, request(), until=2))
    assert end is None and tokens_of(events) == [1, 2]
    assert worker.calls[0].cancelled
    assert_let_go(manager)
    assert cached(manager, d, PROMPT + [1, 2]) == 2  # what it generated is cached there


def test_a_stop_string_ends_the_request_mid_chunk(manager) -> None:
    model = manager.models[0]
    text = model.tokenizer.tokenizer.encode("hello world", add_special_tokens=False)
    worker = FakeWorker([chunk(*text), chunk(finish="length")])
    serve(manager.main, worker)

    events, done = asyncio.run(drive(manager, request(50, stop=["wor"])))
    assert done.finish_reason == "stop" and done.stop_sequence == "wor"
    assert "".join(ev.text for ev in events if isinstance(ev, Delta)) == "hello "
    assert worker.calls[0].cancelled
    assert_let_go(manager)
