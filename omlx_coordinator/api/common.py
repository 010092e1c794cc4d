"""What every protocol adapter needs alike: the Unicode check of a body, the chat template's
encoding of a conversation, SSE framing, a stream whose generation starts before its response
does and that is never silent for long, a reply that notices a client going away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from omlx_coordinator.errors import APIError
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_coordinator.text.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")


class Silence:
    """How long a stream has written nothing. The generation sends a keep-alive only while no
    token comes; tokens that render to nothing (a tool call of a family whose calls do not
    stream, held back until it is whole: tool_calls.py) must not leave the client without a
    byte either: proxies and clients drop a silent stream."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._since = time.monotonic()

    def wrote(self) -> None:
        self._since = time.monotonic()

    def overdue(self) -> bool:
        """Whether a keep-alive is due now (then it counts as written)."""
        if time.monotonic() - self._since < self.seconds:
            return False
        self.wrote()
        return True


def check_unicode(body: object, at: str = "") -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer, grammar compiler or
    node message takes: refuses a body holding one anywhere (a value or a key), naming where
    (`at`: where `body` itself is in the request)."""
    todo: list[tuple[object, str]] = [(body, at)]
    while todo:
        value, at = todo.pop()
        if isinstance(value, str):
            if not _valid(value):
                raise APIError(400, f"{_where(at)} is not valid Unicode: {_surrogate(value)}",
                               param=at or None)
            continue
        if isinstance(value, dict):
            if (key := next((k for k in value if not _valid(k)), None)) is not None:
                raise APIError(400, f"{_where(at)} has a key that is not valid Unicode: "
                                    f"{_surrogate(key)}", param=at or None)
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            continue
        # Reversed onto the stack: the first bad string in the body's order is the one named.
        todo.extend((v, f"{at}.{k}" if at else str(k)) for k, v in reversed(items))


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _where(at: str) -> str:
    return f"'{at}'" if at else "the request body"


def _surrogate(text: str) -> str:
    i = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
    return f"it holds a lone surrogate {text[i]!r} at character {i}"


def encode_chat(tok: ChatTokenizer, messages: list[dict], tools: list[dict] | None,
                param: str = "messages") -> list[int]:
    """The prompt's token ids. A chat template that rejects the messages (roles, order...) is
    the request's fault: a 400 naming `param`, where they came from."""
    try:
        return tok.encode_chat(messages, tools)
    except APIError:
        raise
    except Exception as e:
        raise APIError(400, f"the chat template rejected the messages: {e}",
                       param=param) from e


_SEARCH_TOOLS = ("web_search", "web_fetch")
_left_out: set[str] = set()  # search tool types already logged as left out


def leaves_out(tool_type: str) -> bool:
    """Whether a provider's server tool of this type is left out of the prompt rather than
    refused: a search tool (web search, web fetch) is one the model may use or not, and one that
    answers without searching answers as the API allows, while Codex sends `web_search` in every
    request of its default config. Tools that run code or act for the model stay refused."""
    if not tool_type.startswith(_SEARCH_TOOLS):
        return False
    if tool_type not in _left_out and len(_left_out) < 32:
        _left_out.add(tool_type)
        log.info("leaving %s tools out of prompts: no web search here", tool_type[:64])
    return True


def sse(obj: dict, event: str | None = None) -> str:
    """One server-sent event (orjson: several times faster than json, which at many streams
    is felt per token)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {orjson.dumps(obj).decode()}\n\n"


class Primed:
    """An async generator whose first step starts now, in a task of its own. A streamed reply's
    call to the node then goes out while Starlette sends the headers and sets up the stream
    (time a prompt's first token would wait for otherwise), not after. Iterate it once;
    `aclose()` ends it however far it got."""

    def __init__(self, gen: AsyncGenerator):
        self.gen = gen
        self.first: asyncio.Future | None = asyncio.ensure_future(anext(gen))

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self):
        if self.first is None:
            return await anext(self.gen)
        first, self.first = self.first, None
        return await first

    async def aclose(self) -> None:
        if (first := self.first) is not None:
            self.first = None
            first.cancel()  # the generation unwinds: its node sequence is cancelled
            await asyncio.wait({first})
            if not first.cancelled():
                first.exception()  # retrieved: a step that failed unread is no error to log
        await self.gen.aclose()


# What a stream may take past the request's own time limit to write its last events.
SEND_GRACE_SECONDS = 10.0


class ClosingStream(StreamingResponse):
    """A streamed reply that closes `events` however it ends, even when its body never started
    (a client gone before the headers): a Primed generation would otherwise run on alone. It
    ends at `limit` seconds (the request's time limit and a grace) even while a send waits on a
    client that keeps its connection open but reads nothing: that generation holds its model's
    lease, which an unload, an eviction or a load waiting for room waits for."""

    def __init__(self, content: AsyncIterator[str], events, limit: float,
                 media_type: str = "text/event-stream", **kwargs):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         **kwargs)
        self.events, self.limit = events, limit

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with asyncio.timeout(self.limit + SEND_GRACE_SECONDS):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            log.warning("a stream's client read nothing for the rest of its time limit: "
                        "closed")
        finally:
            await self.events.aclose()


async def collect_unless_gone(request: Request, collect: Callable[[], Awaitable[T]],
                              events: AsyncIterator, metrics: GatewayMetrics,
                              endpoint: str) -> T | Response:
    """Runs `collect` (a non-streaming reply) while watching the client: one that disconnects
    cancels the generation and gets a 499."""
    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
        result = task.result()  # an APIError goes on to the gateway's handler, which counts it
    finally:
        if not task.done():
            task.cancel()
            # Let it unwind (that cancels the node's sequence): closing the generator while the
            # task still runs it raises RuntimeError.
            await asyncio.wait({task}, timeout=5.0)
        if task.done():
            await events.aclose()
    metrics.requests.labels(endpoint, "ok").inc()
    return result
