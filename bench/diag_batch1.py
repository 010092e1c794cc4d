#!/usr/bin/env python3
"""Batch-1 decode of our engine against mlx-lm's, in one process, runs interleaved.

    R  mlx-lm generate_step on mlx-lm's model             (the reference)
    R' mlx-lm's model in the loop S runs                  (does the loop itself cost?)
    S  our StageRunner + KVCache in generate_step's loop  (the stage code alone)
    S' the same on a stream of its own                    (as generate_step runs: does the
                                                           default stream cost the gap?)
    D  our Batcher, a consumer thread reading its events  (+ scheduler, sampling, metrics)
    H  our server over HTTP (`--http`), one stream         (+ worker process, gRPC, gateway,
                                                           SSE; its own processes, started
                                                           once, idle while the others run)

With `--http`, also the CPU each thread of the server's processes and of this process spent a
token (/proc ticks over the rounds' runs): where the server's extra time per token goes.

Every variant runs once as a warm-up, then `--rounds` times in turn (R S S' D R ...), so a
device whose speed drifts during the run (a shared GPU's clocks) moves all of them alike.
Prints each variant's median decode rate and its ratio to R; for the loops it times (R', S,
S'), the median milliseconds a step spends building its graph and then waiting for the device:
a loop that never waits is bound by its Python, one that waits by the device.

    python bench/diag_batch1.py --random-llama 8b [--tokens 128] [--rounds 5] [--http]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_single_node as bsn  # noqa: E402
from diag_engine import stage_loop  # noqa: E402


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def thread_ticks(pids: list[int]) -> dict[tuple[str, str], int]:
    """utime + stime clock ticks of every thread of `pids`, by (process, thread): a thread is
    its name and id, "main" for the process's first (Python names its threads only inside)."""
    out: dict[tuple[str, str], int] = {}
    for pid in pids:
        named = bsn.proc_ticks(pid)
        if named is None:
            continue
        for tid, (name, ticks) in bsn.thread_ticks(pid).items():
            out[(f"{named[0]} [{pid}]", "main" if tid == pid else f"{name} {tid}")] = ticks
    return out


class CpuLedger:
    """CPU ticks of the threads of some processes, summed over measured runs, and the tokens
    those runs made."""

    def __init__(self) -> None:
        self.ticks: dict[tuple[str, str], int] = {}
        self.tokens = 0

    def measure(self, pids: list[int], run) -> float:
        before = thread_ticks(pids)
        tps, tokens = run()
        after = thread_ticks(pids)
        for key, t in after.items():
            self.ticks[key] = self.ticks.get(key, 0) + t - before.get(key, 0)
        self.tokens += tokens
        return tps

    def report(self, title: str) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        print(f"{title}: CPU ms a token over {self.tokens} tokens (threads over 0.01 ms)")
        for (proc, thread), t in sorted(self.ticks.items(), key=lambda kv: -kv[1]):
            ms = 1e3 * t / hz / max(self.tokens, 1)
            if ms >= 0.01:
                print(f"  {ms:7.3f}  {proc[-60:]:60s} {thread}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--http", action="store_true",
                    help="add H, our server over HTTP, and the CPU a token of its threads")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    model_path, _, _, _ = bsn.select_model(args, work, dict(os.environ))

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from omlx_node.batcher import Batcher, Finish, SeqRequest
    from omlx_node.metrics import NodeMetrics
    from omlx_node.stage import StageRunner

    model, _ = load_model(model_path)
    mx.eval(model.parameters())
    stage = StageRunner(model_path)
    batcher = Batcher(stage, NodeMetrics())
    prompt = list(range(100, 132))

    def reference(n: int) -> float:
        times = []
        for _ in generate_step(mx.array(prompt), model, max_tokens=n,
                               prompt_cache=make_prompt_cache(model)):
            times.append(time.perf_counter())
        return rate(times)

    class MlxLmModel:
        """mlx-lm's model as stage_loop calls a stage."""

        def make_cache(self) -> list:
            return make_prompt_cache(model)

        def __call__(self, x: mx.array, cache: list, last_only: bool = False) -> mx.array:
            out = model(x, cache=cache)
            return out[:, -1:, :] if last_only else out

    phases: dict[str, list[tuple[float, float]]] = {}

    def looped(name: str, runner, stream=None):
        def run(n: int) -> float:
            with mx.stream(stream or mx.default_stream(mx.default_device())):
                return rate(stage_loop(runner, prompt, n, phases=phases.setdefault(name, [])))
        return run

    own = mx.new_stream(mx.default_device())

    count = [0]

    def engine(n: int) -> float:
        count[0] += 1
        seq = batcher.submit(SeqRequest(f"r{count[0]}", prompt, n))
        times: list[float] = []

        def consume() -> None:
            while not isinstance(seq.events.get(timeout=60), Finish):
                times.append(time.perf_counter())

        reader = threading.Thread(target=consume)
        reader.start()
        while reader.is_alive():
            batcher.step()
        return rate(times)

    ledgers = {"R": CpuLedger(), "H": CpuLedger()}
    me = [os.getpid()]

    def reference_counted(n: int) -> float:
        return ledgers["R"].measure(me, lambda: (reference(n), n))

    server = loop = client = None
    if args.http:
        import httpx

        server = bsn.Server(model_path, work / "server.log", [])
        server.wait_ready(bsn.SERVER_START_TIMEOUT)
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(timeout=120)

    def http(n: int) -> float:
        def one() -> tuple[float, int]:
            res = loop.run_until_complete(bsn.stream_one(client, server.base, prompt, n))
            return res["decode_tps"], res["tokens"]
        return ledgers["H"].measure(server.pids() + me, one)

    variants = {"R mlx-lm generate_step": reference_counted,
                "R' mlx-lm's model, S's loop": looped("R'", MlxLmModel()),
                "S our stage, generate_step's loop": looped("S", stage),
                "S' the same, on a stream of its own": looped("S'", stage, own),
                "D our Batcher + consumer thread": engine}
    if server is not None:
        variants["H our server over HTTP"] = http
    try:
        run_rounds(variants, phases, ledgers, args)
    finally:
        if server is not None:
            loop.run_until_complete(client.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            server.stop()
    return 0


def run_rounds(variants: dict, phases: dict, ledgers: dict[str, CpuLedger], args) -> None:
    """A warm-up of every variant, then `args.rounds` rounds of them in turn; prints the
    rates, the loops' step phases and (with H) the CPU a token of each thread."""
    import mlx.core as mx

    for fn in variants.values():
        fn(args.tokens)
    phases.clear()
    ledgers.update({k: CpuLedger() for k in ledgers})
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            runs[name].append(fn(args.tokens))
    base = statistics.median(runs["R mlx-lm generate_step"])
    print(f"{args.tokens} tokens, {args.rounds} interleaved rounds, {mx.default_device()}")
    for name, r in runs.items():
        m = statistics.median(r)
        print(f"{name:36s} {m:8.1f} tok/s  {m / base:5.2f}x  runs {[round(x) for x in r]}")
    for name, steps in phases.items():
        build, wait = (statistics.median(p[i] for p in steps) * 1e3 for i in (0, 1))
        print(f"{name:3s} a step: {build:.2f} ms building its graph, then {wait:.2f} ms waiting")
    if ledgers["H"].tokens:
        ledgers["R"].report("R (this process)")
        ledgers["H"].report("H (the server's processes and this client)")


if __name__ == "__main__":
    sys.exit(main())
