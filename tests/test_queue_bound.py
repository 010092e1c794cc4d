"""The queue bound and its Retry-After (omlx_coordinator/models/admission.py) on an injected clock, and
the per-request buffers a client that reads nothing can fill: each bounded, without processes.
(The live server under overload: tests/test_overload.py.)"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omlx_coordinator.api.openai import _MERGED_EVENTS, _Choices
from omlx_coordinator.errors import APIError
from omlx_coordinator.models import admission as adm
from omlx_coordinator.models.admission import Admission, ReleaseWhenDone, hold, refuse_all_full
from omlx_coordinator.models.model_config import ModelConfigError, from_file
from omlx_coordinator.nodes.worker_session import MAX_UNREAD_CHUNKS, SessionCall
from proto import omlx_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bound_refuses_past_the_limit_and_frees_on_release():
    a = Admission(3, Clock())
    assert [a.admit() for _ in range(3)] == [None, None, None]
    refusal = a.admit()
    assert refusal is not None and (refusal.held, refusal.limit) == (3, 3)
    assert (a.held, a.refused) == (3, 1)
    a.release()
    assert a.admit() is None and a.held == 3


def test_a_request_of_n_choices_holds_n_and_one_wider_than_the_bound_runs_alone():
    a = Admission(4, Clock())
    assert a.admit(3) is None
    assert a.admit(2) is not None  # 3 + 2 > 4
    a.release(3)
    assert a.admit(10) is None and a.held == 4  # alone: as much as the whole bound
    assert a.admit() is not None
    a.release(10)
    assert a.held == 0


def test_retry_after_is_the_drain_time_of_what_is_held_at_the_measured_rate():
    clock = Clock()
    a = Admission(8, clock)
    clock.now += 500  # idle: not time it drained slowly in
    for _ in range(8):
        a.admit()
    assert a.drain_rate() == 0.0
    assert a.retry_after() == adm.UNMEASURED_RETRY_SECONDS  # nothing finished yet
    clock.now += 10  # 4 finish in 10 busy seconds: 0.4 a second
    for _ in range(4):
        a.release()
        a.admit()
    assert a.drain_rate() == pytest.approx(0.4)
    assert a.retry_after() == 20  # 8 held / 0.4 per second
    clock.now += 2 * adm.DRAIN_WINDOW_SECONDS  # those are forgotten: no rate again
    assert a.retry_after() == adm.UNMEASURED_RETRY_SECONDS


def test_retry_after_stays_within_its_range():
    clock = Clock()
    a = Admission(1000, clock)
    a.admit(1000)
    clock.now += 0.5
    a.release(1000)  # all at once, half a second each
    a.admit(1)
    assert a.retry_after() == adm.MIN_RETRY_SECONDS  # one held: half a second
    a.admit(999)
    clock.now += adm.DRAIN_WINDOW_SECONDS + 1
    a.release(1)  # one in a busy minute of 1000 held: those before are forgotten
    a.admit(1)
    assert a.retry_after() == adm.MAX_RETRY_SECONDS


def test_a_burst_drains_at_a_full_batch_rate_not_one_request_at_a_time():
    clock = Clock()
    a = Admission(32, clock, slots=8)
    for _ in range(4):  # requests one at a time, half a second each
        a.admit()
        clock.now += 0.5
        a.release()
    for _ in range(32):  # then a burst fills the bound
        a.admit()
    # Eight run at once, half a second each: the 32 drain in 2 s, not in 32 x 0.5 s.
    assert a.drain_rate() == pytest.approx(16)
    assert a.retry_after() == 2
    clock.now += 0.5  # eight finish; the next eight take the slots
    for _ in range(8):
        a.release()
        a.admit()
    assert a.retry_after() == 2  # 12 finished in 6 slot-seconds: 16 a second at a full batch


def test_refused_before_the_body_only_while_every_model_is_full():
    clock = Clock()
    a, b = Admission(1, clock), Admission(2, clock)
    a.admit()
    assert refuse_all_full([a, b]) is None  # b has room: the route decides by the model
    b.admit(2)
    refusal = refuse_all_full([a, b])
    assert refusal is not None and (a.refused, b.refused) == (1, 1)
    assert refusal.retry_after == adm.UNMEASURED_RETRY_SECONDS


def test_undecided_requests_count_as_held_in_every_model_until_decided():
    """A burst is refused from its headers once the requests still running toward admission
    could take every model's room; each leaves the undecided when admitted or ended."""
    clock = Clock()
    a, b = Admission(2, clock), Admission(3, clock)
    arrivals = adm.Arrivals(clock=clock)
    scopes: list[dict] = [{adm._SCOPE_KEY: []} for _ in range(3)]
    for scope in scopes[:2]:
        assert refuse_all_full([a, b], arrivals.undecided) is None
        arrivals.arrived(scope)
    assert refuse_all_full([a, b], arrivals.undecided) is None  # b has room for a third
    arrivals.arrived(scopes[2])
    refusal = refuse_all_full([a, b], arrivals.undecided)
    assert refusal is not None and refusal.held == 3 and (a.held, b.held) == (0, 0)
    hold(scopes[0], a)  # admitted: held, no longer undecided
    assert (arrivals.undecided, a.held) == (2, 1)
    adm.Arrivals.decided(scopes[0])  # once only
    assert arrivals.undecided == 2
    with pytest.raises(APIError):
        hold(scopes[1], _full(clock))  # refused: decided too
    assert arrivals.undecided == 1
    adm.Arrivals.decided(scopes[2])  # ended before admission (ReleaseWhenDone's finally)
    assert arrivals.undecided == 0


def test_a_request_counts_as_undecided_for_a_while_only():
    """One whose body comes slowly stops counting after the window: it cannot have every other
    request refused while it dribbles in."""
    clock = Clock()
    a = Admission(2, clock)
    arrivals = adm.Arrivals(window=1.0, clock=clock)
    slow = [{} for _ in range(2)]
    for scope in slow:
        arrivals.arrived(scope)
    assert refuse_all_full([a], arrivals.undecided) is not None
    clock.now += 1.5
    assert arrivals.undecided == 0 and refuse_all_full([a], arrivals.undecided) is None
    adm.Arrivals.decided(slow[0])  # decided at last: nothing left to take back
    assert arrivals.undecided == 0


def _full(clock: Clock) -> Admission:
    full = Admission(1, clock)
    full.admit()
    return full


def test_a_models_config_sets_a_bound_per_model(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[[model]]\nname = "a"\npath = "/m/a"\nmax_queue = 12\n'
                    '[[model]]\nname = "b"\npath = "/m/b"\n')
    assert [m.max_queue for m in from_file(path)] == [12, None]  # None: --max-queue's
    path.write_text('[[model]]\nname = "a"\npath = "/m/a"\nmax_queue = 0\n')
    with pytest.raises(ModelConfigError, match="max_queue must be a positive integer"):
        from_file(path)


def test_default_bound_is_four_batches():
    assert adm.default_bound(8) == 32
    assert adm.default_bound(None) == adm.DEFAULT_MAX_QUEUE == 256


def test_held_until_the_response_is_done_whatever_ends_it():
    asyncio.run(_held_until_the_response_is_done_whatever_ends_it())


async def _held_until_the_response_is_done_whatever_ends_it():
    """A stream's places are held until it is sent, an error's freed at once; a refusal is a
    429 with Retry-After before the route does anything else."""
    a = Admission(2, Clock())
    app = FastAPI()
    app.add_middleware(ReleaseWhenDone)
    gate = asyncio.Event()
    worked: list[str] = []

    @app.exception_handler(APIError)
    async def _error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.post("/stream")
    async def stream(request: Request) -> StreamingResponse:
        hold(request.scope, a)
        worked.append("stream")

        async def body():
            yield b"a"
            await gate.wait()
            yield b"b"
        return StreamingResponse(body())

    @app.post("/fail")
    async def fail(request: Request) -> None:
        hold(request.scope, a)
        raise APIError(400, "bad")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        assert (await client.post("/fail")).status_code == 400
        assert a.held == 0
        streams = [asyncio.create_task(client.post("/stream")) for _ in range(2)]
        while a.held < 2:
            await asyncio.sleep(0.01)
        refused = await client.post("/stream")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == adm.OVERLOADED
        assert int(refused.headers["retry-after"]) >= adm.MIN_RETRY_SECONDS
        assert worked == ["stream", "stream"]  # the refused one did no work
        gate.set()
        assert [(await s).text for s in streams] == ["ab", "ab"]
    assert a.held == 0


class _Stream:
    """What a SessionCall needs of its Session call: where cancels go."""

    def __init__(self) -> None:
        self.calls: dict[str, SessionCall] = {}
        self.sent: list[pb.SessionRequest] = []

    def send(self, request: pb.SessionRequest) -> None:
        self.sent.append(request)


def test_a_sequence_nobody_reads_is_cancelled_at_its_unread_bound():
    asyncio.run(_a_sequence_nobody_reads_is_cancelled_at_its_unread_bound())


async def _a_sequence_nobody_reads_is_cancelled_at_its_unread_bound():
    stream = _Stream()
    call = SessionCall(stream, "r1", timeout=60)
    stream.calls["r1"] = call
    for i in range(MAX_UNREAD_CHUNKS + 50):
        call._feed(pb.TokenChunk(tokens=[i]))
    assert call.items.qsize() == MAX_UNREAD_CHUNKS + 1  # the chunks, then why it ended
    assert [r.cancel for r in stream.sent] == ["r1"]  # the worker stops generating for it
    assert "r1" not in stream.calls
    items = [call.items.get_nowait() for _ in range(MAX_UNREAD_CHUNKS + 1)]
    assert isinstance(items[-1], grpc.aio.AioRpcError)
    assert items[-1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "read nothing" in items[-1].details()


def test_n_choices_nobody_reads_stop_at_the_merged_bound():
    asyncio.run(_n_choices_nobody_reads_stop_at_the_merged_bound())


async def _n_choices_nobody_reads_stop_at_the_merged_bound():
    """A request's n generations are pumped into one queue: with no reader they wait on it
    (and so read no more of their own bounded queues) instead of filling it."""
    pulled = [0, 0, 0]

    async def endless(i: int):
        while True:
            pulled[i] += 1
            yield i
            await asyncio.sleep(0)

    choices = _Choices(endless, 3)
    for i in range(3):
        choices._start(i)
    for _ in range(200):
        await asyncio.sleep(0)
    assert choices.queue.qsize() == _MERGED_EVENTS
    assert sum(pulled) <= _MERGED_EVENTS + 3  # each pump holds at most one more
    await choices.aclose()
