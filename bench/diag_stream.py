#!/usr/bin/env python3
"""Batch-1 decode of our StageRunner on MLX's default stream and on a stream of its own (as
mlx-lm's generate_step runs), against generate_step itself: does the stream explain a gap?

    python bench/diag_stream.py --random-llama 1b [--tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_single_node as bsn
from diag_engine import rate, stage_loop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from omlx_node.stage import StageRunner

    model_path, _, _, _ = bsn.select_model(args, Path(tempfile.mkdtemp()), dict(os.environ))
    prompt = list(range(100, 132))
    model, _ = load_model(model_path)
    mx.eval(model.parameters())
    stage = StageRunner(model_path)
    own = mx.new_stream(mx.default_device())

    def a() -> float:
        times = []
        for _ in generate_step(mx.array(prompt), model, max_tokens=args.tokens,
                               prompt_cache=make_prompt_cache(model)):
            times.append(time.perf_counter())
        return rate(times)

    def b() -> float:
        return rate(stage_loop(stage, prompt, args.tokens))

    def b_own() -> float:
        with mx.stream(own):
            return rate(stage_loop(stage, prompt, args.tokens))

    cases = {"A generate_step": a, "B stage, default stream": b, "B' stage, own stream": b_own}
    for fn in cases.values():
        fn()  # warm-up
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved
        for name, fn in cases.items():
            runs[name].append(fn())
    base = statistics.median(runs["A generate_step"])
    for name, r in runs.items():
        m = statistics.median(r)
        print(f"{name:28s} {m:8.1f} tok/s  {m / base:5.2f}  runs {[round(x) for x in r]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
