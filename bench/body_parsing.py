#!/usr/bin/env python3
"""What a request body costs the gateway, and everyone else while it is parsed (issue 49):
each body below is sent to a live `serve` while one stream decodes and a client polls /health;
the body's answer time is put beside orjson's own parse of the same bytes here (the reference:
no gateway can read JSON faster than its parser), and /health's and the stream's gaps beside
the same gaps with no body in flight. Medians of `--runs`.

Bodies: the attacker's ~30 MB of tiny objects with a NaN at its end, without a key and with one;
a valid ~30 MB body (one long string: a pasted file); bodies at the structure bound (the most objects
and arrays a request may hold), of invalid and of valid messages (the tiny model's context
refuses the latter after validation).

    python -m bench.body_parsing [--runs 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

from bench.common import RESULTS, Server, machine_info
from omlx_coordinator.http.request_body import MAX_CONTAINERS
from tests.tiny_models import build_model

KEY = "sk-bench-body-parsing"
FLOOD = b'{"model": "bench", "x": [' + b",".join([b'{"a":1}'] * 3_700_000) + b", NaN]}"
VALID = {"model": "bench", "prompt": "Once", "max_tokens": 1}
# name: (body, keyed, the same request without its bulk: what answering it costs anyway)
BODIES = {
    "30 MB of tiny objects + NaN, no key": (FLOOD, False, b'{"x": [NaN]}'),
    "30 MB of tiny objects + NaN, keyed": (FLOOD, True, b'{"model": "bench", "x": [NaN]}'),
    "30 MB valid (one long string), keyed": (
        orjson.dumps({**VALID, "user": "u" * 30_000_000}), True, orjson.dumps(VALID)),
    "30 MB valid (10M commas in a string), keyed": (
        orjson.dumps({**VALID, "user": "," * 30_000_000}), True, orjson.dumps(VALID)),
    f"{MAX_CONTAINERS} invalid messages (the bound), keyed": (orjson.dumps({
        "model": "bench", "max_tokens": 1, "messages": [{}] * (MAX_CONTAINERS - 10)}), True,
        orjson.dumps({"model": "bench", "max_tokens": 1, "messages": [{}]})),
    f"{MAX_CONTAINERS} messages (the bound), keyed": (orjson.dumps({
        "model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * (
            MAX_CONTAINERS - 10)}), True,
        orjson.dumps({"model": "bench", "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}]})),
}


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)] if xs else float("nan")


def send(url: str, body: bytes, keyed: bool) -> tuple[float, int]:
    path = "/v1/chat/completions" if b'"messages"' in body[:80] else "/v1/completions"
    """(seconds to the answer, its status); without a key, over a raw socket as an attacker
    would (an HTTP client stops at the early 401 with an error of its own)."""
    t = time.perf_counter()
    if keyed:
        r = httpx.post(url + path, content=body, timeout=600,
                       headers={"authorization": f"Bearer {KEY}",
                                "content-type": "application/json"})
        return time.perf_counter() - t, r.status_code
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=600) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body)))
        try:
            s.sendall(body)
        except OSError:  # closed after the 401, as it should be
            pass
        answer = s.recv(4096)
    return time.perf_counter() - t, int(answer.split()[1]) if answer else 0


def during(url: str, action) -> dict:
    """/health latencies and stream gaps while `action()` runs (None: one second of quiet)."""
    health: list[float] = []
    gaps: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/health")
                health.append(time.perf_counter() - t)
                time.sleep(0.01)

    async def stream() -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            while not stop.is_set():  # one stream after another, for as long as it takes
                async with c.stream("POST", url + "/v1/completions",
                                    headers={"authorization": f"Bearer {KEY}"},
                                    json={"model": "bench", "prompt": "Once", "max_tokens": 1500,
                                          "ignore_eos": True, "stream": True}) as r:
                    last = None
                    async for _ in r.aiter_lines():
                        now = time.perf_counter()
                        if last is not None and not stop.is_set():
                            gaps.append(now - last)
                        last = now
                        if stop.is_set():
                            return

    streamer = threading.Thread(target=lambda: asyncio.run(stream()))
    poller = threading.Thread(target=poll)
    streamer.start()
    poller.start()
    time.sleep(1.0)  # the stream is decoding
    health.clear()
    gaps.clear()
    out = {"answer_s": None, "status": None}
    if action is None:
        time.sleep(2.0)
    else:
        out["answer_s"], out["status"] = action()
    stop.set()
    poller.join(60)
    streamer.join(60)
    return {**out, "health_p99_ms": p99(health) * 1e3, "gap_p99_ms": p99(gaps) * 1e3,
            "health_max_ms": max(health, default=float("nan")) * 1e3}


def orjson_parse_s(body: bytes) -> float:
    t = time.perf_counter()
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-body-"))
    model = build_model(work / "tiny", "llama", num_layers=2, hidden_size=64, seed=0)
    server = Server(model, work / "server.log", ["--api-key", KEY])
    rows = []
    try:
        server.wait_ready(300)
        quiet = [during(server.base, None) for _ in range(args.runs)]
        base_health = statistics.median(q["health_p99_ms"] for q in quiet)
        base_gap = statistics.median(q["gap_p99_ms"] for q in quiet)
        for name, (body, keyed, small) in BODIES.items():
            runs = [during(server.base, lambda b=body, k=keyed: send(server.base, b, k))
                    for _ in range(args.runs)]
            ref = statistics.median(orjson_parse_s(body) for _ in range(args.runs))
            without = statistics.median(send(server.base, small, keyed)[0]
                                        for _ in range(args.runs))
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("answer_s", "health_p99_ms", "gap_p99_ms", "health_max_ms")}
            rows.append({"body": name, "bytes": len(body), "status": runs[-1]["status"],
                         "orjson_parse_s": ref, "small_answer_s": without, **med,
                         "bulk_over_orjson": (med["answer_s"] - without) / ref})
    finally:
        server.stop()
    machine = machine_info()
    result = {"machine": machine, "runs": args.runs, "quiet_health_p99_ms": base_health,
              "quiet_gap_p99_ms": base_gap, "rows": rows}
    lines = [f"# Request bodies and the event loop ({machine['cpu']}, {machine['cpu_count']} "
             f"cores, commit {machine['git_commit']})", "",
             f"`python -m bench.body_parsing --runs {args.runs}`: medians of {args.runs}. "
             "A tiny model streams one request; a client polls /health every 10 ms.", "",
             f"With no body in flight: /health p99 {base_health:.1f} ms, stream gap p99 "
             f"{base_gap:.1f} ms.", "",
             "The bulk's cost is the answer's time less that of the same request without its "
             "bulk; it includes sending the bytes over loopback.", "",
             "| body | status | answer (s) | without the bulk (s) | orjson alone (s) | bulk / "
             "orjson | /health p99 (ms) | /health max (ms) | stream gap p99 (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['body']} | {r['status']} | {r['answer_s']:.3f} | "
                     f"{r['small_answer_s']:.3f} | "
                     f"{r['orjson_parse_s']:.3f} | {r['bulk_over_orjson']:.2f} | "
                     f"{r['health_p99_ms']:.1f} | {r['health_max_ms']:.1f} | "
                     f"{r['gap_p99_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "body-parsing-cpu.md").write_text(text)
    (args.out / "body-parsing-cpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
