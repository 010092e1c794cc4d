"""What every protocol adapter needs alike: text checks, SSE framing, a reply that notices a
client going away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response

from omlx_coordinator.errors import APIError
from omlx_coordinator.metrics import GatewayMetrics

T = TypeVar("T")


def check_text(text: str, param: str) -> None:
    """JSON may carry lone UTF-16 surrogates that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"'{param}' is not valid Unicode: it holds a lone surrogate "
                            f"{text[e.start]!r} at character {e.start}", param=param) from None


def sse(obj: dict, event: str | None = None) -> str:
    """One server-sent event (orjson: several times faster than json, which at many streams
    is felt per token)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {orjson.dumps(obj).decode()}\n\n"


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
