"""An HTTP proxy on loopback that refuses every request and keeps where each one wanted to go:
an agent client run with HTTP(S)_PROXY pointed at it has no network, and the test sees every
host it tried to reach (a client that skips its proxy for a host still meets the sandbox)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_REFUSAL = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _refuse(conn: socket.socket, attempts: list[str]) -> None:
    with conn:
        conn.settimeout(5)
        try:
            # "CONNECT host:443 HTTP/1.1" for https, "GET http://host/path HTTP/1.1" for http.
            line = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
            attempts.append(line)
            conn.sendall(_REFUSAL)
        except OSError:
            pass


@contextmanager
def refusing_proxy() -> Iterator[tuple[str, list[str]]]:
    """(the proxy's URL, the request line of every attempt so far) while the context lasts."""
    attempts: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)  # accept() wakes to see the context end
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_refuse, args=(conn, attempts), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", attempts
    finally:
        done.set()
        thread.join(timeout=10)
        listener.close()
