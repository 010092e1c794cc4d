"""Many sequences over one Session call to a live shard worker (proto ShardWorker.Session): the
gateway's client (omlx_coordinator/nodes/worker_session.py) against the worker's side
(omlx_node/session.py), in separate processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import signal
import threading
import time

import grpc
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx_coordinator.nodes.worker_session import WorkerSession
from omlx_coordinator.request.retry import RETRIABLE
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.helpers.node import running_node
from tests.helpers.session import generate_chunks, wait_idle, worker_load
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow  # a real shard worker process

PROMPTS = ["The capital of France is", "One two three", "def main():", "Hello"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """(worker address, model folder) of a node's worker holding every layer of a tiny qwen3."""
    model = build_model(tmp_path_factory.mktemp("session-model"), "qwen3", num_layers=2)
    with running_node(tmp_path_factory.mktemp("session-node")) as (_, agent):
        reply = agent.LoadShard(pb.LoadShardRequest(model_path=str(model), model_id="m"),
                                timeout=120)
        yield reply.worker_address, model


@pytest.fixture(scope="module")
def reference(worker):
    """Each prompt's token ids and mlx-lm's greedy continuation of 24 tokens."""
    ref_model, tok = load(str(worker[1]))
    out = []
    for text in PROMPTS:
        ids = tok.encode(text)
        out.append((ids, [int(t) for t, _ in generate_step(mx.array(ids), ref_model,
                                                            max_tokens=24)]))
    return out


RUNNING, WAITING = "omlx_node_requests_processing", "omlx_node_requests_deferred"
GENERATED = "omlx_node_tokens_predicted_total"


def _load(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        return worker_load(pb_grpc.ShardWorkerStub(channel))


def _wait_idle(address: str) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        return wait_idle(pb_grpc.ShardWorkerStub(channel))


async def _collect(call) -> list[pb.TokenChunk]:
    return [chunk async for chunk in call]


def _request(rid: str, ids: list[int], max_tokens: int, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_tokens=ids, max_tokens=max_tokens, **kw)


def test_sequences_of_a_session_stream_mlx_lm_tokens_one_message_per_step(worker, reference):
    address, _ = worker

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
            calls = [session.generate(_request(f"r{i}", ids, 24), timeout=60)
                     for i, (ids, _) in enumerate(reference)]
            out = await asyncio.gather(*(_collect(c) for c in calls))
            session.close()
            return out

    for (ids, ref), chunks in zip(reference, asyncio.run(run())):
        assert [t for c in chunks for t in c.tokens] == ref
        assert chunks[0].prompt_tokens == len(ids) and chunks[0].cached_tokens == 0
        assert chunks[-1].finish_reason == "length"

    # On the wire: a step's tokens of every sequence of the session come in one message.
    requests = [pb.SessionRequest(generate=_request(f"w{i}", ids, 24))
                for i, (ids, _) in enumerate(reference)]
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ShardWorkerStub(channel)
        finished, widest, tokens = set(), 0, {}
        gate = iter(requests)

        def sends():
            yield from gate
            while len(finished) < len(requests):  # the session ends when its requests do
                time.sleep(0.01)

        for message in stub.Session(sends(), timeout=60):
            widest = max(widest, len(message.events))
            for event in message.events:
                tokens.setdefault(event.request_id, []).extend(event.chunk.tokens)
                if event.chunk.finish_reason:
                    finished.add(event.request_id)
            if len(finished) == len(requests):
                break
    assert widest == len(requests)
    assert [tokens[f"w{i}"] for i in range(len(reference))] == [ref for _, ref in reference]


def test_a_bad_request_fails_alone_and_cancels_free_their_sequences(worker, reference):
    address, _ = worker
    (ids, ref), (other_ids, other_ref) = reference[0], reference[1]

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
            good = session.generate(_request("good", ids, 24), timeout=60)
            bad = session.generate(_request("bad", [10**7], 4), timeout=60)
            long = session.generate(_request("long", other_ids, 1500), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(bad)
            first = await long.__aiter__().__anext__()
            assert long.cancel() and not long.cancel()  # the second is a no-op
            good_chunks = await _collect(good)
            after = _wait_idle(address)
            # Another sequence after those runs on the same session as if alone.
            again = await _collect(session.generate(_request("again", other_ids, 24),
                                                    timeout=60))
            session.close()
            return err.value, first, good_chunks, after, again

    err, first, good_chunks, after, again = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.details()
    assert first.prompt_tokens == len(other_ids)
    assert [t for c in good_chunks for t in c.tokens] == ref
    assert after[RUNNING] == 0 and after[WAITING] == 0
    assert [t for c in again for t in c.tokens] == other_ref


def test_a_request_too_large_for_one_message_fails_alone(worker, reference):
    """A request over the worker's message limit (a huge grammar, from a schema an attacker
    pads) is refused before it is sent: sent, gRPC would end the whole Session call, failing
    every sequence it carries."""
    address, _ = worker
    (ids, ref), (other_ids, _) = reference[0], reference[1]

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
            running = session.generate(_request("running", other_ids, 300), timeout=60)
            first = await running.__aiter__().__anext__()
            big = session.generate(_request("big", ids, 4, grammar="x" * (5 << 20)),
                                   timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(big)
            rest = await _collect(running)
            after = await _collect(session.generate(_request("after", ids, 24), timeout=60))
            session.close()
            return err.value, [first, *rest], after

    err, chunks, after = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5.0 MiB" in err.details() and "schemas" in err.details(), err.details()
    assert sum(len(c.tokens) for c in chunks) == 300 and chunks[-1].finish_reason == "length"
    assert [t for c in after for t in c.tokens] == ref


def test_a_session_that_ends_cancels_its_sequences_and_deadlines_hold(worker, reference):
    address, _ = worker
    ids = reference[0][0]
    before = _load(address)[GENERATED]

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
            # A deadline a tenth of what its 1500 tokens take on a quick machine.
            late = session.generate(_request("late", ids, 1500), timeout=0.05)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(late)
            idle_after_deadline = _wait_idle(address)
            calls = [session.generate(_request(f"gone{i}", ids, 1500), timeout=60)
                     for i in range(3)]
            for call in calls:
                await call.__aiter__().__anext__()
            session.close()  # the gateway went away: every sequence of the call is freed
            return err.value, idle_after_deadline

    err, idle_after_deadline = asyncio.run(run())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert idle_after_deadline[RUNNING] == 0
    idle = _wait_idle(address)
    assert idle[RUNNING] == 0 and idle[WAITING] == 0
    # Four sequences of up to 1500 tokens each, all stopped early.
    assert idle[GENERATED] - before < 3000


def test_logprobs_and_a_worker_that_goes_away(worker, reference, tmp_path):
    """Logprobs come the same over the gateway's session and a test's own; a session whose
    worker is gone fails each of its sequences with UNAVAILABLE, the status the gateway runs a request again on."""
    address, _ = worker
    ids = reference[0][0]
    with grpc.insecure_channel(address) as channel:
        alone = generate_chunks(pb_grpc.ShardWorkerStub(channel),
                                _request("lp", ids, 6, logprobs=True, top_logprobs=3), 60)

    async def run(addr: str, request: pb.GenerateRequest):
        async with grpc.aio.insecure_channel(addr) as channel:
            session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
            try:
                return await _collect(session.generate(request, timeout=10))
            finally:
                session.close()

    chunks = asyncio.run(run(address, _request("lp2", ids, 6, logprobs=True, top_logprobs=3)))
    flat = [lp for c in chunks for lp in c.logprobs]
    assert [t for c in chunks for t in c.tokens] == [t for c in alone for t in c.tokens]
    assert [(round(lp.logprob, 4), list(lp.top_ids)) for lp in flat] == \
        [(round(lp.logprob, 4), list(lp.top_ids)) for c in alone for lp in c.logprobs]

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run("127.0.0.1:1", _request("nowhere", ids, 4)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stopping_worker_ends_its_session_after_the_last_events(tmp_path):
    """SIGTERM to the worker: its running sequence ends "aborted" (the gateway runs it again
    elsewhere), the session call then ends, and a sequence sent after fails rather than
    waiting on a worker that is gone, with a status the gateway runs it again on: UNAVAILABLE,
    or INTERNAL when gRPC meets the server half-way through its stop."""
    model = build_model(tmp_path / "m", "qwen3", num_layers=2)
    (tmp_path / "node").mkdir()
    with running_node(tmp_path / "node") as (_, agent):
        reply = agent.LoadShard(pb.LoadShardRequest(model_path=str(model), model_id="m"),
                                timeout=120)

        async def run():
            async with grpc.aio.insecure_channel(reply.worker_address) as channel:
                session = WorkerSession(pb_grpc.ShardWorkerStub(channel), ())
                call = session.generate(_request("long", [5, 6, 7], 1500), timeout=60)
                chunks = [await call.__aiter__().__anext__()]
                os.kill(reply.worker_pid, signal.SIGTERM)
                async for chunk in call:
                    chunks.append(chunk)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _collect(session.generate(_request("after", [5, 6], 4), timeout=30))
                session.close()
                return chunks, err.value

        chunks, err = asyncio.run(run())
    assert chunks[-1].finish_reason == "aborted"
    assert sum(len(c.tokens) for c in chunks) < 1500
    assert err.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL}
    assert err.code() in RETRIABLE


class _LiveCall:
    """What `Session.messages` asks of its gRPC call: whether the client is still there."""

    def is_active(self) -> bool:
        return True


def test_a_session_says_its_engine_advanced_while_it_has_nothing_to_send(worker, reference):
    """A long prefill sends no token: each second the engine advanced, the handler sends an
    empty message (the gateway's --stall-timeout sees progress, not silence); an engine that
    does not step (a wedged pipeline) leaves it silent."""
    from omlx_node import session as session_module
    from omlx_node.batcher import Batcher
    from omlx_node.metrics import NodeMetrics
    from omlx_node.session import Session
    from omlx_node.stage import StageRunner

    engine = Batcher(StageRunner(worker[1]), NodeMetrics(), prefill_chunk=1, speculative="off")
    session = Session(engine, 8, concurrent.futures.ThreadPoolExecutor(1))
    out: queue.Queue = queue.Queue()
    handler = threading.Thread(target=lambda: [out.put(m) for m in session.messages(_LiveCall())],
                               daemon=True)
    handler.start()
    ids = reference[0][0]
    assert len(ids) > 4  # a prefill of several one-token steps
    session._take(_request("a", ids, 4))
    wait = 2.5 * session_module.POLL_SECONDS
    with pytest.raises(queue.Empty):
        out.get(timeout=wait)  # the engine never stepped: nothing to say
    engine.step()  # one prompt token: no token to send yet
    message = out.get(timeout=wait)
    assert not message.events  # progress, nothing more
    with pytest.raises(queue.Empty):
        out.get(timeout=wait)  # no step since: silent
    session.close("done")
    handler.join(10)


def test_a_session_holds_steps_for_its_interval_but_never_a_first_token_or_an_end(worker,
                                                                                  reference):
    """Steps that come faster than the stream interval (here 1000 s: forever) go out together;
    a sequence's first token, while another's tokens are held, and a sequence's end go out at
    once. The engine runs on this thread, one step at a time; the handler's messages are read
    on another."""
    from omlx_node.batcher import Batcher
    from omlx_node.metrics import NodeMetrics
    from omlx_node.session import Session
    from omlx_node.stage import StageRunner

    # One token a step (no drafts): the steps counted below are tokens.
    engine = Batcher(StageRunner(worker[1]), NodeMetrics(), speculative="off")
    session = Session(engine, 8, concurrent.futures.ThreadPoolExecutor(1), interval=1000.0)
    out: queue.Queue = queue.Queue()
    handler = threading.Thread(target=lambda: [out.put(m) for m in session.messages(_LiveCall())],
                               daemon=True)
    handler.start()

    def step_until_message() -> pb.SessionEvents:
        for _ in range(100):
            engine.step()
            try:
                message = out.get(timeout=0.5)
            except queue.Empty:
                continue
            if message.events:  # not an empty one: that says the engine advanced, no more
                return message
        raise AssertionError("no message in 100 steps")

    (a_ids, a_ref), (b_ids, b_ref) = reference[0], reference[1]
    session._take(_request("a", a_ids, 12))
    first = step_until_message()  # a session's first message is never held
    assert [e.request_id for e in first.events] == ["a"]
    for _ in range(3):
        engine.step()  # a's tokens, held
    session._take(_request("b", b_ids, 6))
    with_b = step_until_message()  # b's first token: urgent
    b_first = next(e.chunk for e in with_b.events if e.request_id == "b")
    assert len(b_first.tokens) == 1 and not b_first.finish_reason
    a_held = next(e.chunk for e in with_b.events if e.request_id == "a")
    assert len(a_held.tokens) >= 3  # the held steps, in one message
    messages = [first, with_b]

    def ended(request_id: str) -> bool:
        return any(e.chunk.finish_reason for m in messages for e in m.events
                   if e.request_id == request_id)
    # Which ends first depends on when the engine's pace prefilled b's prompt.
    while not (ended("a") and ended("b")):
        messages.append(step_until_message())  # each sequence's end: urgent
    session.close("done")
    handler.join(10)
    assert not handler.is_alive()
    tokens: dict[str, list[int]] = {}
    for m in messages:
        for e in m.events:
            tokens.setdefault(e.request_id, []).extend(e.chunk.tokens)
    assert tokens == {"a": a_ref[:12], "b": b_ref[:6]}
    # a: its first message, the held steps with b's first, then each one's end (with what
    # was held since): no message a step.
    assert len(messages) <= 4


def test_a_fault_building_one_sequences_event_ends_that_request_alone(worker, reference,
                                                                      monkeypatch):
    """A bug that raises while one sequence's event is built (here injected for request "a")
    ends that request with an error chunk; the session call and its other sequences go on."""
    from omlx_node import session as session_module
    from omlx_node.batcher import Batcher
    from omlx_node.metrics import NodeMetrics
    from omlx_node.session import Session
    from omlx_node.stage import StageRunner

    real = session_module.fill_chunk

    def faulty(chunk, seq, tokens, finish, first):
        if seq.request_id == "a" and not first:
            raise IndexError("injected")
        return real(chunk, seq, tokens, finish, first)

    monkeypatch.setattr(session_module, "fill_chunk", faulty)
    engine = Batcher(StageRunner(worker[1]), NodeMetrics())
    session = Session(engine, 8, concurrent.futures.ThreadPoolExecutor(1))
    out: queue.Queue = queue.Queue()
    handler = threading.Thread(target=lambda: [out.put(m) for m in session.messages(_LiveCall())],
                               daemon=True)
    handler.start()
    (a_ids, _), (b_ids, b_ref) = reference[0], reference[1]
    session._take(_request("a", a_ids, 12))
    session._take(_request("b", b_ids, 12))
    events: dict[str, list] = {"a": [], "b": []}
    for _ in range(200):
        engine.step()
        try:
            while True:
                for e in out.get(timeout=0.2).events:
                    events[e.request_id].append(e.chunk)
        except queue.Empty:
            pass
        if any(c.finish_reason for c in events["b"]):
            break
    session.close("done")
    handler.join(10)
    assert not handler.is_alive()
    a_end = [c for c in events["a"] if c.finish_reason]
    assert [c.finish_reason for c in a_end] == ["error"] and "injected" in a_end[0].error
    assert [t for c in events["b"] for t in c.tokens] == b_ref[:12]
    assert events["b"][-1].finish_reason == "length"
