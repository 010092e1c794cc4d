"""A head worker's Session call for tests that drive a worker without a gateway, synchronous:
sequences started and cancelled by id over one call, as the gateway runs them
(omlx_coordinator/nodes/worker_session.py), each read as an iterator of its TokenChunks that raises
grpc.RpcError with the status the worker ended it with."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import httpx

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.conftest import parse_metrics

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SequenceError(grpc.RpcError):
    """How the worker ended a sequence, read as a failed call's error is."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SessionClient:
    def __init__(self, stub: pb_grpc.ShardWorkerStub, metadata: tuple = ()):
        self._sends: queue.Queue = queue.Queue()
        self._sequences: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._call = stub.Session(iter(self._sends.get, None), metadata=metadata)
        threading.Thread(target=self._read, name="test-session", daemon=True).start()

    def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the session"
        try:
            for message in self._call:
                for event in message.events:
                    with self._lock:
                        sequence = self._sequences.get(event.request_id)
                    if sequence is not None:
                        sequence.put(event)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        with self._lock:
            sequences = list(self._sequences.values())
        for sequence in sequences:
            sequence.put(SequenceError(code, details))

    def generate(self, request: pb.GenerateRequest, timeout: float = 120.0
                 ) -> Iterator[pb.TokenChunk]:
        """Starts a sequence now; iterate the result for its chunks."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            self._sequences[request.request_id] = events
        self._sends.put(pb.SessionRequest(generate=request))
        return _chunks(events, time.monotonic() + timeout)

    def cancel(self, request_id: str) -> None:
        self._sends.put(pb.SessionRequest(cancel=request_id))

    def close(self) -> None:
        """Ends the call: the worker cancels every sequence of it still running."""
        self._sends.put(None)
        self._call.cancel()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *_) -> None:
        self.close()


def _chunks(events: queue.Queue, deadline: float) -> Iterator[pb.TokenChunk]:
    while True:
        try:
            event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise SequenceError(grpc.StatusCode.DEADLINE_EXCEEDED, "no chunk in time") from None
        if isinstance(event, SequenceError):
            raise event
        if event.status_code:
            if event.chunk.tokens:
                yield event.chunk
            raise SequenceError(_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN),
                                event.status_details)
        yield event.chunk
        if event.chunk.finish_reason:
            return


def generate_chunks(stub: pb_grpc.ShardWorkerStub, request: pb.GenerateRequest,
                    timeout: float = 120.0) -> list[pb.TokenChunk]:
    """One sequence's chunks over a Session call of its own."""
    with SessionClient(stub) as session:
        return list(session.generate(request, timeout))


def worker_load(stub: pb_grpc.ShardWorkerStub) -> dict[str, float]:
    """The head worker's /metrics: its sequences running (omlx_node_requests_processing),
    waiting (omlx_node_requests_deferred) and the tokens it generated."""
    port = stub.Health(pb.HealthRequest(), timeout=5).metrics_port
    return parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)


def wait_idle(stub: pb_grpc.ShardWorkerStub, timeout: float = 10.0) -> dict[str, float]:
    """The worker's metrics once no sequence runs or waits (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        load = worker_load(stub)
        busy = load["omlx_node_requests_processing"] + load["omlx_node_requests_deferred"]
        if not busy or time.monotonic() > deadline:
            return load
        time.sleep(0.05)
