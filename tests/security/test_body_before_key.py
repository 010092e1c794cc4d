"""Work before the key check (issue 49, part 1): a request without a valid key is answered 401
before its body is read, and the connection closed; a body is parsed once, by orjson; a large
one in the parser process, so the event loop every stream shares keeps answering.

The bounds below (seconds) are far above what these take; they tell a stalled event loop from
a served one, they do not measure (bench/body_parsing.py does)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from omlx_coordinator.errors import APIError
from omlx_coordinator.http.request_body import (
    LIGHT_ITEMS,
    MAX_CONTAINERS,
    _light,
    parse,
    parse_bounded,
)
from tests.conftest import Server, start_server

KEY = "sk-body-before-key-test"
# The attacker's body: ~30 MB of tiny objects with a NaN at its end (orjson refuses it only at
# the end; the old second parse by json took 12 s and 2 GB).
FLOOD = b'{"model": "m", "x": [' + b",".join([b'{"a":1}'] * 3_700_000) + b", NaN]}"


def test_refusals_say_what_and_where() -> None:
    cases = {b'{"a": NaN}': ["NaN", "line 1 column 7"],
             b'{"a": "\\ud800"}': ["not valid Unicode", "surrogate"],
             b'{"a": "\xff"}': ["not valid UTF-8", "0xff", "offset 7"],
             b"[" * 2000 + b"]" * 2000: ["too deeply"],
             b'{"a": 1' + b"0" * 5000 + b"}": ["number too large"],
             b'{"a": }': ["not valid JSON", "line 1 column 7"],
             b"  ": ["empty"]}
    for body, words in cases.items():
        with pytest.raises(APIError) as e:
            parse(body)
        assert e.value.status == 400 and all(w in e.value.message for w in words), (
            body[:40], e.value.message)
    assert parse(b'{"a": [1, "x"]}') == {"a": [1, "x"]}


def test_the_parser_process_bounds_the_structure() -> None:
    ok = orjson.dumps({"messages": [{"role": "user", "content": "x"}] * 1000})
    assert parse_bounded(ok) == (orjson.loads(ok), None)
    value, why = parse_bounded(orjson.dumps([[]] * (MAX_CONTAINERS + 1)))
    assert value is None and str(MAX_CONTAINERS) in why
    assert parse_bounded(b'{"a": NaN}')[1].startswith("the request body is not valid JSON")


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory) -> Server:
    with start_server(tiny_model_path, "--api-key", KEY,
                      home=tmp_path_factory.mktemp("home")) as s:
        yield s


class _HealthPoller(threading.Thread):
    """/health's answer times, polled until stopped (the test sends a body meanwhile)."""

    def __init__(self, server: Server):
        super().__init__()
        self.server, self.latencies, self.stop = server, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.is_set() and len(self.latencies) < 10_000:
                t = time.perf_counter()
                c.get(self.server.url + "/health")
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.02)

    def done(self) -> list[float]:
        self.stop.set()
        self.join(60)
        return self.latencies


@pytest.mark.slow
def test_a_keyless_body_is_refused_before_it_is_read(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(FLOOD) + FLOOD[:65536])
        answer, deadline = b"", time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:  # the server closed the connection: the rest is never read
                break
            answer += chunk
        else:
            pytest.fail(f"the connection stayed open: {answer[:300]!r}")
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"connection: close" in answer.lower() and b"invalid_api_key" in answer
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.slow
def test_a_keyed_flood_is_parsed_off_the_event_loop(server: Server) -> None:
    """30 MB of tiny objects with a key: refused (400) after orjson's one pass in the parser
    process, while /health and a running stream keep being served."""
    poller = _HealthPoller(server)
    gaps: list[float] = []

    async def stream() -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            async with c.stream("POST", server.url + "/v1/completions", headers={
                    "authorization": f"Bearer {KEY}"}, json={
                    "model": server.model_id, "prompt": "Once", "max_tokens": 1500,
                    "ignore_eos": True, "stream": True}) as r:
                last = time.perf_counter()
                async for _ in r.aiter_lines():
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

    runner = threading.Thread(target=lambda: asyncio.run(stream()))
    runner.start()
    poller.start()
    time.sleep(1)
    r = httpx.post(server.url + "/v1/chat/completions", content=FLOOD, timeout=300,
                   headers={"authorization": f"Bearer {KEY}",
                            "content-type": "application/json"})
    latencies = poller.done()
    runner.join(300)
    assert r.status_code == 400, r.text[:500]
    assert "not valid JSON" in r.json()["error"]["message"]
    # The event loop answered /health and kept the stream going all along (a loop stalled by
    # the parse went seconds between answers).
    assert latencies and max(latencies) < 2.0, sorted(latencies)[-5:]
    assert len(gaps) > 100 and max(gaps[1:]) < 2.0, sorted(gaps)[-5:]


@pytest.mark.slow
def test_a_large_valid_body_is_served(server: Server) -> None:
    """Large bodies, mostly text (parsed inline) or holding many commas (parsed in the parser
    process), are served as any other; one with more objects and arrays than any request needs
    is refused, saying so."""
    for filler in ("u", ","):  # `user` is metadata, taken without effect
        big = {"model": server.model_id, "prompt": "Once", "max_tokens": 2,
               "user": filler * (LIGHT_ITEMS + 1000)}
        assert _light(orjson.dumps(big)) == (filler == "u")
        r = httpx.post(server.url + "/v1/completions", json=big, timeout=300,
                       headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text[:500]
    many = {"model": server.model_id, "prompt": "x", "stop": [[]] * (MAX_CONTAINERS + 1)}
    r = httpx.post(server.url + "/v1/completions", json=many, timeout=300,
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and str(MAX_CONTAINERS) in r.json()["error"]["message"], r.text
