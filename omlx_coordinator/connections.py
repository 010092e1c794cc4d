"""Connection hygiene for the gateway's HTTP server: slow and idle sockets cannot exhaust it.

uvicorn waits for a request's headers without a deadline, so a client that opens sockets and
sends nothing, or a header a byte at a time (slowloris), holds them for good. The gateway's
protocol (uvicorn's httptools one, extended) gives every request's headers a deadline from the
connection's start or the request's first byte, and bounds the open connections: past the
bound a new connection closes the oldest one still waiting for its headers, and only when
every connection is mid-request is the newcomer itself closed. A real client sends its headers
at once, so it is never the one let go.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
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
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle until the next request (uvicorn's keep-alive timeout closes it): first in line
        # to be let go past the bound, with no header deadline until its next request begins.
        self._idle_since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._idle_since = None
        super().connection_lost(exc)


def guarded(header_timeout: float, max_connections: int) -> type[GuardedHttp]:
    """The protocol class for uvicorn.Config(http=...), with these bounds."""
    return type("GuardedHttp", (GuardedHttp,), {"header_timeout": header_timeout,
                                                 "max_connections": max_connections})


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
