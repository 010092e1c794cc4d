#!/usr/bin/env python3
"""Garbage-collection pauses in our server's processes under load: startup heap frozen (as
served) against not frozen (the same code with gc.freeze made a no-op), in one run.

Each side starts `omlx-cluster serve` with a probe injected through PYTHONPATH (a
sitecustomize) that times every collection of every process; then `--rounds` rounds of
`--streams` concurrent streamed completions (`--tokens` tokens each, 32-token prompts) and one
`--long-prompt`-token prompt. Prints, per side and process (gateway, agent, shard worker), the
full (generation 2) collections during the load with their median and longest pause, and what
the clients saw: the longest gap between two tokens of a stream (median over streams, and the
worst) and the long prompt's TTFT (median).

    python bench/diag_gc.py [--rounds 20] [--streams 64] [--tokens 64] [--random-llama 1b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_single_node import RANDOM_LLAMAS, Server, diag_model  # noqa: E402

PROBE = """
import gc, json, os, time
_log = os.path.join(os.environ["OMLX_GC_PROBE"], f"{os.getpid()}.jsonl")
_start = [0.0]

def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    elif info["generation"] == 2:
        with open(_log, "a") as f:
            f.write(json.dumps({"t": time.time(), "ms": (time.perf_counter() - _start[0]) * 1e3})
                    + "\\n")

gc.callbacks.append(_timed)
"""
UNFROZEN = "\ngc.freeze = lambda: None  # the reference: nothing is frozen\n"
ROLES = {"serve": "gateway", "node": "agent", "worker": "worker"}


def role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [a.decode() for a in argv]
    return next((ROLES[w] for w in words if w in ROLES), "other")


async def stream(client, base: str, prompt: list[int], tokens: int) -> list[float]:
    """A streamed greedy completion: the arrival time of each token event."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    times = []
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


async def load(base: str, args, vocab: int, rng: random.Random) -> dict:
    import httpx

    gaps, ttfts = [], []
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        for _ in range(args.rounds):
            prompts = [[rng.randrange(10, vocab) for _ in range(32)]
                       for _ in range(args.streams)]
            runs = await asyncio.gather(*(stream(client, base, p, args.tokens) for p in prompts))
            gaps += [max(b - a for a, b in zip(t, t[1:])) * 1e3 for t in runs if len(t) > 2]
            t0 = time.perf_counter()
            first = await stream(client, base, [rng.randrange(10, vocab)
                                                for _ in range(args.long_prompt)], 2)
            ttfts.append((first[0] - t0) * 1e3)
    return {"gap_median_ms": statistics.median(gaps), "gap_max_ms": max(gaps),
            "long_ttft_ms": statistics.median(ttfts)}


def side(model: Path, work: Path, frozen: bool, args, vocab: int) -> dict:
    probe = work / ("frozen" if frozen else "unfrozen")
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE + ("" if frozen else UNFROZEN))
    env = dict(os.environ, OMLX_GC_PROBE=str(probe), PYTHONPATH=os.pathsep.join(
        filter(None, [str(probe), str(REPO), os.environ.get("PYTHONPATH")])))
    server = Server(model, probe / "server.log", [], env=env)
    try:
        server.wait_ready(600)
        asyncio.run(load(server.base, argparse.Namespace(**{**vars(args), "rounds": 1}),
                         vocab, random.Random(0)))  # warm-up: kernels, pools, first objects
        t0 = time.time()
        seen = asyncio.run(load(server.base, args, vocab, random.Random(1)))
        t1 = time.time()
        roles = {pid: role(pid) for pid in server.pids()}
    finally:
        server.stop()
    pauses: dict[str, list[float]] = {}
    for pid, name in roles.items():
        log = probe / f"{pid}.jsonl"
        if name in ROLES.values() and log.exists():
            rows = [json.loads(line) for line in log.read_text().splitlines()]
            pauses.setdefault(name, []).extend(r["ms"] for r in rows if t0 <= r["t"] <= t1)
    return {"clients": seen, "pauses": pauses, "load_seconds": t1 - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS),
                    help="a random llama of that shape (default: a tiny test model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="diag-gc-") as tmp:
        work = Path(tmp)
        model, vocab = diag_model(work, args.random_llama, 4 * args.long_prompt)
        print(f"{args.rounds} rounds of {args.streams} streams x {args.tokens} tokens and one "
              f"{args.long_prompt}-token prompt; model: {args.random_llama or 'tiny'}")
        print("| side | process | full collections | median pause | longest pause |")
        print("|---|---|---:|---:|---:|")
        seen = {}
        for frozen in (True, False):
            name = "frozen (ours)" if frozen else "not frozen"
            r = side(model, work, frozen, args, vocab)
            seen[name] = r["clients"]
            for proc in ("gateway", "agent", "worker"):
                ms = r["pauses"].get(proc, [])
                print(f"| {name} | {proc} | {len(ms)} | "
                      f"{statistics.median(ms) if ms else 0:.1f} ms | "
                      f"{max(ms, default=0):.1f} ms |", flush=True)
        print("\n| side | longest token gap, median stream | worst stream | long-prompt TTFT |")
        print("|---|---:|---:|---:|")
        for name, c in seen.items():
            print(f"| {name} | {c['gap_median_ms']:.1f} ms | {c['gap_max_ms']:.1f} ms | "
                  f"{c['long_ttft_ms']:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
