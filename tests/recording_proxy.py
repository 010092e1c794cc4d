"""A loopback HTTP proxy in front of a live server that keeps every request it passes on (method,
path, body, the status the server answered) and streams each answer back as it arrives: what an
agent client sent, seen from outside, with nothing in the server changed for the test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

# Hop-by-hop headers (RFC 9110 7.6.1), and the framing the proxy redoes itself.
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
                  "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes
    status: int


@contextmanager
def recording_proxy(upstream: str, timeout: float = 600) -> Iterator[tuple[str, list[Exchange]]]:
    """(the proxy's base URL, the exchanges so far, in order) while the context lasts."""
    exchanges: list[Exchange] = []
    client = httpx.Client(base_url=upstream, timeout=timeout)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            # Identity encoding: the answer is passed on byte for byte.
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in _NOT_FORWARDED | {"accept-encoding"}}
            with client.stream(self.command, self.path, content=body, headers=headers) as r:
                exchanges.append(Exchange(self.command, self.path, body, r.status_code))
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in _NOT_FORWARDED:
                        self.send_header(k, v)
                self.send_header("connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    for chunk in r.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()
            self.close_connection = True

        do_GET = do_POST = do_HEAD = _forward

        def log_message(self, *args) -> None:  # the server's own log has every request
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", exchanges
    finally:
        server.shutdown()
        server.server_close()
        client.close()
        thread.join(timeout=10)
