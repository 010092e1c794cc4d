#!/usr/bin/env python3
"""A fresh process's first bursts, step by step: raw mlx-lm's BatchGenerator against our engine
in process (`Batcher`, with and without the prefix cache), each variant in a process of its own
so that its first burst is the process's first MLX work. On MLX's CUDA backend kernels compile
at first use: a fresh server's first 8-stream burst on an H200 waited 18 s for its first tokens
(`diag_burst_h200_1b.md`), raw's 2.4 s. This tells which part of the engine pays it.

    python bench/diag_first_burst.py --random-llama 1b [--streams 8] [--tokens 64] [--bursts 3]

Prints, per variant and burst: time to the first tokens, the decode steps' median and slowest
(ms), the slowest steps' positions, and the median time a step spent building its forward
pass's graph (Python: the model's, or our stage runner's, __call__). A step much longer than
its build is waiting for the device.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_single_node as bsn  # noqa: E402

VARIANTS = ("raw", "ours", "ours_prefix_cache")
BUILDS: list[float] = []  # seconds each forward call of this process took to build its graph


def timed_forward(cls) -> None:
    """Makes `cls.__call__` (a model's forward) append its build time to BUILDS."""
    forward = cls.__call__

    def call(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            BUILDS.append(time.perf_counter() - t)

    cls.__call__ = call


def raw_bursts(model_path: Path, prompts: list[list[int]], tokens: int, bursts: int) -> list:
    """Each burst's [seconds to each step's tokens], BatchGenerator with every prompt at once."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    timed_forward(type(model))
    out = []
    for _ in range(bursts):
        BUILDS.clear()
        start = time.perf_counter()
        gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=len(prompts))
        gen.insert(prompts, max_tokens=[tokens] * len(prompts))
        steps, left = [], len(prompts)
        while left:
            responses = gen.next_generated()
            if responses:
                steps.append(time.perf_counter() - start)
            left -= sum(r.finish_reason is not None for r in responses)
        gen.close()
        out.append({"steps": steps, "builds": list(BUILDS)})
    return out


def our_bursts(model_path: Path, prompts: list[list[int]], tokens: int, bursts: int,
               prefix_cache: bool, work: Path) -> list:
    """The same through our Batcher, stepped on this thread as the worker steps it."""
    from omlx_node.batcher import Batcher, Finish, SeqRequest
    from omlx_node.kv_cache import PrefixCache
    from omlx_node.metrics import NodeMetrics
    from omlx_node.stage import StageRunner

    stage = StageRunner(model_path, 0, None)
    timed_forward(StageRunner)
    metrics = NodeMetrics()
    cache = None
    if prefix_cache:
        info = stage.info
        cache = PrefixCache("diag", (info.layer_start, info.layer_end), 256,
                            hot_max_bytes=1 << 30, ssd_dir=work / "ssd", ssd_max_bytes=1 << 32,
                            metrics_registry=metrics.registry, dtype=info.dtype)
    engine = Batcher(stage, metrics, prefix_cache=cache)
    out = []
    for b in range(bursts):
        BUILDS.clear()
        start = time.perf_counter()
        # A burst of new prompts each time (the prefix cache must not serve them).
        seqs = [engine.submit(SeqRequest(f"{b}-{i}", [b + 1, *p], tokens))
                for i, p in enumerate(prompts)]
        steps, done = [], set()
        while len(done) < len(seqs):
            engine.step()
            got = False
            for i, s in enumerate(seqs):
                while not s.events.empty():
                    event = s.events.get_nowait()
                    got = True
                    if isinstance(event, Finish):
                        done.add(i)
            if got:
                steps.append(time.perf_counter() - start)
        out.append({"steps": steps, "builds": list(BUILDS)})
    if cache is not None:
        cache.close()
    return out


def summary(run: dict) -> str:
    steps, builds = run["steps"], run["builds"]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    slow = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:3]
    return (f"first tokens {1000 * steps[0]:8.1f} ms, then {len(gaps)} steps: median "
            f"{1000 * statistics.median(gaps):6.2f} ms, slowest {1000 * max(gaps):7.1f} ms "
            f"(steps {', '.join(str(i + 1) for i in slow)}), all {1000 * steps[-1]:8.1f} ms; "
            f"forward build median {1000 * statistics.median(builds[-len(gaps):]):5.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--_variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--_model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rng = random.Random(3)
    if args._variant:
        vocab = json.loads((args._model / "config.json").read_text())["vocab_size"]
        prompts = [[rng.randrange(100, vocab - 1) for _ in range(32)]
                   for _ in range(args.streams)]
        work = Path(tempfile.mkdtemp(prefix="omlx-first-burst-"))
        if args._variant == "raw":
            runs = raw_bursts(args._model, prompts, args.tokens, args.bursts)
        else:
            runs = our_bursts(args._model, prompts, args.tokens, args.bursts,
                              args._variant == "ours_prefix_cache", work)
        print(json.dumps(runs))
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-first-burst-"))
    work.mkdir(parents=True, exist_ok=True)
    model = bsn.select_model(args, work, dict(os.environ))[0]
    for variant in VARIANTS:
        proc = subprocess.run(
            [sys.executable, __file__, "--_variant", variant, "--_model", str(model),
             "--streams", str(args.streams), "--tokens", str(args.tokens),
             "--bursts", str(args.bursts)], capture_output=True, text=True,
            timeout=600)
        if proc.returncode:
            print(f"{variant}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        for i, run in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
            print(f"{variant:18s} burst {i}: {summary(run)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
