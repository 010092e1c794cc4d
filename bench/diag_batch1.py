#!/usr/bin/env python3
"""Batch-1 decode of our engine against mlx-lm's, in one process, runs interleaved.

    R  mlx-lm generate_step on mlx-lm's model             (the reference)
    R' mlx-lm's model in the loop S runs                  (does the loop itself cost?)
    S  our StageRunner + KVCache in generate_step's loop  (the stage code alone)
    S' the same on a stream of its own                    (as generate_step runs: does the
                                                           default stream cost the gap?)
    D  our Batcher, a consumer thread reading its events  (+ scheduler, sampling, metrics)

Every variant runs once as a warm-up, then `--rounds` times in turn (R S S' D R ...), so a
device whose speed drifts during the run (a shared GPU's clocks) moves all of them alike.
Prints each variant's median decode rate and its ratio to R; for the loops it times (R', S,
S'), the median milliseconds a step spends building its graph and then waiting for the device:
a loop that never waits is bound by its Python, one that waits by the device.

    python bench/diag_batch1.py --random-llama 8b [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model_path, _, _, _ = bsn.select_model(args, Path(tempfile.mkdtemp()), dict(os.environ))

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

    variants = {"R mlx-lm generate_step": reference,
                "R' mlx-lm's model, S's loop": looped("R'", MlxLmModel()),
                "S our stage, generate_step's loop": looped("S", stage),
                "S' the same, on a stream of its own": looped("S'", stage, own),
                "D our Batcher + consumer thread": engine}
    for fn in variants.values():
        fn(args.tokens)
    phases.clear()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
