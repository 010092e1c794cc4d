"""The gateway's side of a Session call (proto ShardWorker.Session): every sequence the gateway
runs on one head worker goes over one call, whose messages each carry an engine step's tokens of
them all (omlx_node/session.py says why).

`WorkerSession.generate` returns a `SessionCall`, used as a server-streaming call of its own
would be: iterated for TokenChunks, raising grpc.aio.AioRpcError with the status the worker
ended the sequence with (INVALID_ARGUMENT, UNAVAILABLE when the node failed under it,
DEADLINE_EXCEEDED past its timeout), and `cancel()` frees the sequence on the worker. When the
call itself fails (the worker went away), each of its sequences fails with that call's status,
and the next sequence opens a new call. A request larger than a message the worker takes is not
sent: it would end the call, and every sequence the call carries with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# The largest message a worker's gRPC server takes (gRPC's default, which it keeps).
MAX_MESSAGE_BYTES = 4 << 20
# The most chunks of a sequence the gateway keeps unread. A client that reads nothing stops its
# request's consumer, and the worker would go on generating into this queue without bound (one
# call carries every sequence, so it cannot be paused for one); past it the sequence is
# cancelled on the worker and ends with RESOURCE_EXHAUSTED. A chunk is one stream interval
# (20 ms) of tokens, or one token with --stream-interval 0: a client this far behind has read
# nothing for seconds, and its chunks hold at most a few MB.
MAX_UNREAD_CHUNKS = 1024


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a call that ended with `code` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionCall:
    """One sequence of a session."""

    def __init__(self, stream: _Stream, request_id: str, timeout: float):
        self._stream, self.request_id = stream, request_id
        # Its TokenChunks, then an AioRpcError if it fails; nothing after a chunk that
        # finishes it or an error.
        self.items: asyncio.Queue[pb.TokenChunk | grpc.aio.AioRpcError] = asyncio.Queue()
        self._open = True
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def __aiter__(self) -> AsyncIterator[pb.TokenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[pb.TokenChunk]:
        while True:
            item = await self.items.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason:
                return

    def cancel(self) -> bool:
        """Frees the sequence on the worker (a no-op once it has ended); True if it had not."""
        if not self._open:
            return False
        self._close()
        self._stream.send(pb.SessionRequest(cancel=self.request_id))
        return True

    def _feed(self, item: pb.TokenChunk | grpc.aio.AioRpcError) -> None:
        if not self._open:
            return
        if self.items.qsize() >= MAX_UNREAD_CHUNKS:
            self.cancel()
            self.items.put_nowait(rpc_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the client read nothing while {MAX_UNREAD_CHUNKS} chunks of tokens were "
                "generated for it: the request was ended to bound the server's memory"))
            return
        self.items.put_nowait(item)
        if isinstance(item, Exception) or item.finish_reason:
            self._close()

    def _close(self) -> None:
        self._open = False
        self._timer.cancel()
        self._stream.calls.pop(self.request_id, None)

    def _expire(self) -> None:
        if self._open:
            self._feed(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._stream.send(pb.SessionRequest(cancel=self.request_id))


class _Stream:
    """One Session call and the sequences sent over it."""

    def __init__(self, stub: pb_grpc.ShardWorkerStub, metadata: tuple[tuple[str, str], ...]):
        self.calls: dict[str, SessionCall] = {}
        self.heard = time.monotonic()  # the last message from the worker (or the call's start)
        self._sends: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        self._call = stub.Session(self._requests(), metadata=metadata)
        self.task = asyncio.create_task(self._read())

    @property
    def alive(self) -> bool:
        return not self.task.done()

    def send(self, request: pb.SessionRequest) -> None:
        self._sends.put_nowait(request)

    async def _requests(self) -> AsyncIterator[pb.SessionRequest]:
        # Ends when the call does (None): grpc.aio leaves the task that sends them running.
        while (request := await self._sends.get()) is not None:
            yield request

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the session"
        try:
            async for message in self._call:
                self.heard = time.monotonic()
                for event in message.events:
                    call = self.calls.get(event.request_id)
                    if call is None:  # cancelled here: its last events cross the cancel
                        continue
                    if event.status_code:
                        if event.chunk.tokens:
                            call._feed(event.chunk)
                        call._feed(rpc_error(_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN),
                                             event.status_details))
                    else:
                        call._feed(event.chunk)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
        except Exception as e:  # the call's own failure, whatever it is: its sequences fail
            code, details = grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"
        finally:
            self._sends.put_nowait(None)
            for call in list(self.calls.values()):
                call._feed(rpc_error(code, details))

    def close(self) -> None:
        self._call.cancel()


class WorkerSession:
    """The Session calls to one head worker: one at a time, opened by the first sequence after
    the last one failed."""

    def __init__(self, stub: pb_grpc.ShardWorkerStub, metadata: tuple[tuple[str, str], ...]):
        self._stub, self._metadata = stub, metadata
        self._stream: _Stream | None = None

    def generate(self, request: pb.GenerateRequest, timeout: float) -> SessionCall:
        """Starts a sequence; iterate the result for its TokenChunks."""
        if self._stream is None or not self._stream.alive:
            self._stream = _Stream(self._stub, self._metadata)
        stream = self._stream
        call = SessionCall(stream, request.request_id, timeout)
        stream.calls[request.request_id] = call
        message = pb.SessionRequest(generate=request)
        if (size := message.ByteSize()) > MAX_MESSAGE_BYTES:
            call._feed(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, _too_large(request, size)))
        else:
            stream.send(message)
        return call

    def silent_seconds(self) -> float:
        """How long the worker has sent nothing while sequences of this session were open (0
        while none is). A worker whose engine advances sends at least an empty message a
        second (omlx_node/session.py): silence means its steps stopped, not a long prefill."""
        if self._stream is None or not self._stream.alive or not self._stream.calls:
            return 0.0
        return time.monotonic() - self._stream.heard

    def open_sequences(self) -> int:
        """Sequences of the live session not yet ended (a plan a move replaced serves them)."""
        if self._stream is None or not self._stream.alive:
            return 0
        return len(self._stream.calls)

    def unread(self) -> int:
        """The most chunks a live sequence has waiting for its request to read them."""
        if self._stream is None:
            return 0
        return max((c.items.qsize() for c in self._stream.calls.values()), default=0)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


def _too_large(request: pb.GenerateRequest, size: int) -> str:
    """Why a request of `size` bytes on the wire cannot go to a worker, and what to shorten."""
    mib = 1 << 20
    why = (f"the request takes {size / mib:.1f} MiB on its way to the node, over the "
           f"{MAX_MESSAGE_BYTES // mib} MiB a node takes in one message")
    if len(request.grammar) > size // 2:
        return (f"{why}: the grammar made from its response_format or tool schemas is "
                f"{len(request.grammar) / mib:.1f} MiB; shorten those schemas (their "
                "descriptions and defaults count too)")
    return f"{why}: shorten the prompt"
