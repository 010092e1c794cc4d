"""Connection hygiene for the gateway's HTTP server: slow and idle sockets cannot exhaust it.

uvicorn waits for a request's headers without a deadline, so a client that opens sockets and
sends nothing, or a header a byte at a time (slowloris), holds them for good. The gateway's
protocol (uvicorn's httptools one, extended) gives every request's headers a deadline from the
connection's start or the request's first byte, and bounds the open connections: past the
bound a new connection closes the oldest one still waiting for its headers, and only when
every connection is mid-request is the newcomer itself closed. A real client sends its headers
at once, so it is never the one let go.

It also answers a request before the app runs, where the app says it can (`answer_at_once`):
under a burst of thousands of requests while every model is at its queue bound, what a refusal
costs is what the gateway spends per request, and the app's path (the ASGI task, middleware,
routing, the route) is most of it. Answered from the protocol, a burst's connections are
refused in about the time it takes to accept them (bench/results/overload-cpu.md).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
import urllib.parse
from collections.abc import Callable, MutableMapping

from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

log = logging.getLogger(__name__)

HEADER_TIMEOUT_SECONDS = 20.0  # a request's headers, from its first byte or the connection's
MAX_CONNECTIONS = 2048
_REPORT_SECONDS = 60.0  # one log line a minute about connections let go


class _Report:
    """Counts connections let go and says so at most once a minute."""

    def __init__(self) -> None:
        self.counts = {"slow": 0, "over the bound": 0}
        self._said = 0.0

    def note(self, why: str) -> None:
        self.counts[why] += 1
        now = time.monotonic()
        if now - self._said >= _REPORT_SECONDS:
            self._said = now
            log.warning("closed connections that sent no whole request header within %.0f s: "
                        "%d; over the bound of %d connections: %d (since the last line)",
                        GuardedHttp.header_timeout, self.counts["slow"],
                        GuardedHttp.max_connections, self.counts["over the bound"])
            self.counts = dict.fromkeys(self.counts, 0)


_report = _Report()


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for headers and a bound on connections
    (set from `serve --header-timeout` and `--max-connections` before the server starts)."""

    header_timeout = HEADER_TIMEOUT_SECONDS
    max_connections = MAX_CONNECTIONS
    # The app's answer to a request from its scope (method, path, query, headers) before the
    # app runs, or None to run the app: set by `guarded`.
    answer_at_once: Callable[[MutableMapping], Response | None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._answered = False  # answered at once: the connection closes, nothing more is read
        self._idle_since: float | None = time.monotonic()  # None while a request is served
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._make_room():
            _report.note("over the bound")
            transport.close()
            return
        self._arm()

    def _make_room(self) -> bool:
        """Closes the connection idle longest (waiting for a request or for its headers);
        False if every other one is mid-request."""
        idle = [c for c in self.connections
                if c is not self and getattr(c, "_idle_since", None) is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        _report.note("over the bound")
        oldest._let_go()
        return True

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        _report.note("slow")
        self._let_go()

    def _let_go(self) -> None:
        self._disarm()
        self._idle_since = None
        self.connections.discard(self)  # now: a burst of newcomers must not pick it twice
        if not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a keep-alive connection's next request: its headers have a deadline too

    def on_headers_complete(self) -> None:
        self._disarm()
        self._idle_since = None
        if self._answered:  # a request pipelined behind one answered at once: never served
            return
        # Not a request pipelined behind one still being answered (it runs in its own time),
        # nor one that asks for an upgrade (a websocket's scope is another's): the app is told
        # of each request it was asked about that runs (admission.Arrivals), so each must run
        # now, in the scope it was asked about.
        if (self.answer_at_once is not None
                and (self.cycle is None or self.cycle.response_complete)
                and not self.parser.should_upgrade()
                and (response := self._answer()) is not None):
            self._send_and_close(response)
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._answered:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._answered:
            super().on_message_complete()

    def _answer(self) -> Response | None:
        """The app's answer from the request's scope as far as the headers make it."""
        raw_path, _, query = self.url.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        self.scope.update(method=self.parser.get_method().decode("ascii"), path=path,
                          raw_path=raw_path, query_string=query,
                          http_version=self.parser.get_http_version())
        return self.answer_at_once(self.scope)

    def _send_and_close(self, response: Response) -> None:
        """`response` written whole, as the app would have sent it, and the connection closed
        (whatever of the body is still to come is not read)."""
        self._answered = True
        head = [STATUS_LINE[response.status_code]]
        headers = [*self.server_state.default_headers, *response.raw_headers]
        if not any(name == b"connection" for name, _ in response.raw_headers):
            headers.append((b"connection", b"close"))
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", response.body]))
        self.transport.close()
        if self.access_log:  # uvicorn's line, for the same filters (access_log.py)
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope),
                                    self.scope["method"], get_path_with_query_string(self.scope),
                                    self.scope["http_version"], response.status_code)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle until the next request (uvicorn's keep-alive timeout closes it): first in line
        # to be let go past the bound, with no header deadline until its next request begins.
        self._idle_since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._idle_since = None
        super().connection_lost(exc)


def guarded(header_timeout: float, max_connections: int,
            answer_at_once: Callable[[MutableMapping], Response | None] | None = None,
            ) -> type[GuardedHttp]:
    """The protocol class for uvicorn.Config(http=...), with these bounds and the app's
    `answer_at_once` (staticmethod: a plain function, not bound to the protocol)."""
    return type("GuardedHttp", (GuardedHttp,), {
        "header_timeout": header_timeout, "max_connections": max_connections,
        "answer_at_once": staticmethod(answer_at_once) if answer_at_once else None})


def raise_open_files(connections: int) -> int:
    """Raises this process's open-file limit so that `connections` sockets fit beside the
    model files, logs and gRPC channels (macOS starts processes at 256); returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, new, e)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("the open-file limit (%d) is below --max-connections plus room for the "
                    "rest (%d): raise it (ulimit -n) or lower --max-connections", soft, want)
    return soft
