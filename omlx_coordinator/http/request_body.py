"""A request's JSON body: read under a size cap, parsed once by orjson, and kept off the event
loop that carries every stream when it is large.

One parser, one pass: a body orjson refuses is refused, with orjson's position (NaN, a lone
surrogate, invalid UTF-8 and nesting past 1024 levels are not JSON it takes), never parsed again by
another parser (a large body of tiny objects with a NaN at its end cost seconds and gigabytes of a
second parse before the key was even checked: bench/results/body-parsing-cpu.md). A body with many
objects, arrays or values is parsed in a parser process: orjson holds the GIL for the whole parse
(seconds for tens of MB of tiny objects), so a thread would stall every stream as much. That
process also refuses a body whose structure no request needs (more than MAX_CONTAINERS objects and
arrays or MAX_VALUES values), so what comes back to the event loop, and what the request models
validate, stays small.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import orjson
from fastapi import Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_coordinator.errors import APIError

MAX_BODY_BYTES = 32 << 20  # as Anthropic's API
# A body with at most these braces and commas (upper bounds of its objects, arrays and values: a
# brace or comma inside a string counts too) parses inline quickly, however long its strings;
# counting them is a cheap scan of the bytes. Agents' bodies hold a few hundred of each.
LIGHT_CONTAINERS = 10_000
LIGHT_ITEMS = 100_000
# What no request needs: the parser process refuses more. The request models validate what
# comes back on the event loop, at a cost per object or array (more where each is an error).
# (bench/results/body-parsing-cpu.md)
MAX_CONTAINERS = 20_000
MAX_VALUES = 200_000


class BodyRefused(StarletteHTTPException):
    """An APIError met while FastAPI reads a body (it lets only HTTP exceptions through)."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


def too_large(size: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes or more; at most {MAX_BODY_BYTES} "
                         "(32 MiB, as Anthropic's API) are taken", code="request_too_large")


def parse(body: bytes) -> object:
    """The body's JSON value; APIError 400 saying why orjson refused it."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, _refusal(body, e)) from None


def _refusal(body: bytes, e: orjson.JSONDecodeError) -> str:
    where = f"at line {e.lineno} column {e.colno}"
    if "depth limit" in e.msg:
        return ("the request body nests JSON arrays or objects too deeply (over 1024 levels); "
                "no field of the API takes more than a few")
    if "not valid UTF-8" in e.msg:
        try:
            body.decode("utf-8")  # C speed, no objects: only to say where
        except UnicodeDecodeError as u:
            return (f"the request body is not valid UTF-8 (byte 0x{u.object[u.start]:02x} at "
                    f"offset {u.start}); send JSON text in UTF-8")
        return f"the request body holds text that is not valid Unicode {where}"
    if "surrogate" in e.msg:
        return (f"the request body holds a string that is not valid Unicode (a lone UTF-16 "
                f"surrogate such as \\ud800) {where}")
    if "infinity" in e.msg:
        return (f"the request body holds a number too large for any field {where}; no field "
                "of the API takes one that long")
    if body[e.pos:e.pos + 3] in (b"NaN", b"Inf", b"-In"):
        return (f"the request body is not valid JSON {where}: NaN and Infinity are not JSON "
                "numbers, and no field takes them")
    if not body.strip():
        return "the request body is empty: send a JSON object"
    return f"the request body is not valid JSON: {e.msg} {where}"


def parse_bounded(body: bytes) -> tuple[object, str | None]:
    """(the value, None), or (None, why it is refused): the parser process's work. Returns
    rather than raises, so nothing but plain data crosses the process boundary."""
    try:
        value = parse(body)
    except APIError as e:
        return None, e.message
    containers = values = 0
    todo = [value]
    while todo:
        v = todo.pop()
        values += 1
        if isinstance(v, dict):
            containers += 1
            todo.extend(v.values())
        elif isinstance(v, list):
            containers += 1
            todo.extend(v)
        if containers > MAX_CONTAINERS or values > MAX_VALUES:
            return None, (f"the request body holds more than {MAX_CONTAINERS} JSON objects and "
                          f"arrays or {MAX_VALUES} values; no request of the API needs that many")
    return value, None


def _light(body: bytes) -> bool:
    """Whether the body parses inline in little time: few objects, arrays and values."""
    return (body.count(b"{") + body.count(b"[") <= LIGHT_CONTAINERS
            and body.count(b",") <= LIGHT_ITEMS)


class _Parser:
    """One parser process, started on the first large body; a crashed one is replaced."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, body: bytes) -> object:
        for _ in range(2):
            if self._pool is None:
                # spawn: the gateway runs threads (gRPC, uvicorn), which fork must not copy.
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context(
                    "spawn"))
            try:
                value, why = await asyncio.wrap_future(self._pool.submit(parse_bounded, body))
            except BrokenProcessPool:
                self.close()
                continue
            if why is not None:
                raise APIError(400, why)
            return value
        raise APIError(503, "the request body's parser process failed twice; try again",
                       type="server_error")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


_parser = _Parser()
atexit.register(_parser.close)


class JSONBodyRequest(Request):
    """A request whose JSON body is read under MAX_BODY_BYTES and parsed as this module says."""

    async def body(self) -> bytes:
        """The body, refused (413) past MAX_BODY_BYTES before more of it is read."""
        if not hasattr(self, "_body"):
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                raise BodyRefused(too_large(int(declared)))
            chunks, size = [], 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise BodyRefused(too_large(size))
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> object:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = parse(body) if _light(body) else await _parser.parse(body)
            except APIError as e:
                raise BodyRefused(e) from None
        return self._json
