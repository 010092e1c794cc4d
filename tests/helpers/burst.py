"""Thousands of HTTP requests at once, each on its own connection, timed by the kernel: what
an overload's refusals are measured with (tests/test_overload.py, bench/overload.py)."""

from __future__ import annotations

import json
import select
import socket
import struct
import time

# Linux's receive timestamps (SO_TIMESTAMPNS, socket(7)); Python names neither.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
BURST_DEADLINE_SECONDS = 300.0  # every answer, admitted ones' generation included
# Between two readings once every request is out: woken by every answer, the client would
# take the cores' time from the server it measures (and each of the server's sends would
# wake it); the answers' times are the kernel's, whenever they are read.
READ_PAUSE_SECONDS = 0.005
# After the server accepted a burst's connections: for its loop to set each one up.
ACCEPTED_SETTLE_SECONDS = 0.2


def burst(url: str, body: dict, n: int, spread: float = 0.0,
          path: str = "/v1/chat/completions", connect_first: bool = False) -> list[dict]:
    """n requests, started evenly over `spread` seconds (0: at once), each on its own
    connection, each with `body` as JSON to `path`; per request what `_answer` says: its
    status, headers, JSON body and the milliseconds from its start to its answer's arrival.

    A request starts as its connection is opened, and is sent as soon as it is open; with
    `connect_first` (and no spread) every connection is opened first, then every request sent
    at once, once the server has accepted every one, each timed from the moment it was sent:
    the server's answer alone, not the connects, which one Python client on the server's own
    cores makes at a few thousand a second (2,000 took it 0.15-0.7 s), nor their accepts.

    One thread on non-blocking sockets and epoll, reading the answers in batches; an answer's
    arrival is the kernel's receive timestamp, not the moment this loop reads it. At 2,000 at once on the server's cores, a
    client's own turn around its event loop (asyncio streams measured ~0.1 ms a connection;
    httpx's pool more, growing with its open connections) otherwise delays every reading, and
    the client would be measured, not the server."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
               "Content-Type: application/json\r\nConnection: close\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    poller = select.epoll()
    socks: dict[int, socket.socket] = {}
    started: dict[int, float] = {}
    answered: dict[int, float] = {}
    received: dict[int, bytes] = {}
    done: set[int] = set()
    deadline = time.monotonic() + spread + BURST_DEADLINE_SECONDS

    def open_one() -> int:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        fd = sock.fileno()
        socks[fd], started[fd], received[fd] = sock, time.time(), b""
        sock.connect_ex((host, int(port)))
        return fd

    def send(fd: int) -> None:
        try:  # small: fits an empty send buffer at once
            socks[fd].sendall(request)
        except OSError:
            done.add(fd)  # refused or reset before it could send: status 0
            return
        poller.register(fd, select.EPOLLIN)

    try:
        if connect_first and not spread:
            waiting = {open_one() for _ in range(n)}
            for fd in waiting:
                poller.register(fd, select.EPOLLOUT)
            while waiting and time.monotonic() < deadline:
                for fd, _ in poller.poll(1.0):
                    poller.unregister(fd)
                    waiting.discard(fd)
            for fd in waiting:  # never connected: status 0
                poller.unregister(fd)
                done.add(fd)
            _wait_accepted(int(port), deadline)
            for fd in socks:
                if fd not in done:
                    send(fd)
                    started[fd] = time.time()  # sent: the kernel holds it for the server
            opened = n
        else:
            opened = 0
        t0 = time.time()
        while len(done) < n and time.monotonic() < deadline:
            while opened < n and time.time() >= t0 + opened * spread / n:
                fd = open_one()
                try:  # on loopback the connection is usually open at once
                    socks[fd].sendall(request)
                    poller.register(fd, select.EPOLLIN)
                except OSError:
                    poller.register(fd, select.EPOLLOUT)  # once connected, send it
                opened += 1
            wait = 1.0 if opened == n else max(0.0, t0 + opened * spread / n - time.time())
            for fd, events in poller.poll(wait):
                sock = socks[fd]
                if events & select.EPOLLOUT:
                    poller.unregister(fd)
                    send(fd)
                    continue
                try:
                    data, ancillary, _, _ = sock.recvmsg(1 << 16, 64)
                except OSError:
                    data, ancillary = b"", []
                for level, kind, stamp in ancillary:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and fd not in answered:
                        seconds, nanoseconds = struct.unpack("qq", stamp[:16])
                        answered[fd] = seconds + nanoseconds / 1e9
                received[fd] += data
                if not data:
                    done.add(fd)
                    poller.unregister(fd)
            if opened == n:  # read in batches: each answer's time is the kernel's anyway
                time.sleep(READ_PAUSE_SECONDS)
    finally:
        poller.close()
        for sock in socks.values():
            sock.close()
    return [_answer(received[fd], started[fd], answered.get(fd)) for fd in socks]


def _wait_accepted(port: int, deadline: float) -> None:
    """Until the server has accepted every connection made to its listening `port` (the
    kernel completes a connect before the server accepts it; Linux's /proc/net/tcp shows a
    listening socket's accept queue as its rx_queue), and its loop has set them up."""
    while time.monotonic() < deadline:
        queued = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    queued += int(fields[4].split(":")[1], 16)
        if not queued:
            break
        time.sleep(0.01)
    time.sleep(ACCEPTED_SETTLE_SECONDS)


def _answer(raw: bytes, started: float, answered: float | None) -> dict:
    """A request's status (0: no answer), headers (lower-case names), body (its JSON, None if
    none or not JSON) and milliseconds to its answer (nan: none)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else 0
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    try:
        body = json.loads(rest)
    except ValueError:
        body = None
    ms = (answered - started) * 1000 if answered is not None else float("nan")
    return {"status": status, "headers": headers, "body": body, "ms": ms}
