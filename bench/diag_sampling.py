#!/usr/bin/env python3
"""Where a sampled step's time goes: our batched sampler's parts on one batch of logits.

On random logits (B, V) in the model's dtype, each variant is timed as a step of its own
(build the graph, evaluate it, wait), the median of `--iters` after a warm-up:

    greedy        argmax: what a greedy batch pays
    ours          sample_batch with temperature 0.8, top-p 0.95, top-k 50 (bench_sampling's);
                  the same with every row seeded; temperature 0.8 alone
    mlx-lm        mlx-lm's make_sampler with the same settings, one call for the batch
    + its parts   the top-k candidates, then the draw among them (filters, noise, choice)
    top-p alone   temperature 0.8 and top-p 0.95 without top-k: ours and mlx-lm's (each
                  sorts the vocabulary)

Prints each one's milliseconds and its cost over greedy.

    python bench/diag_sampling.py [--rows 32 8] [--vocab 128256] [--iters 200] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="the logits' dtype (default: float32 on a CPU, else bfloat16)")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from omlx_node import sampling as smp

    params = smp.SamplingParams(temperature=0.8, top_p=0.95, top_k=50)
    dtype = (getattr(mx, args.dtype) if args.dtype
             else mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
    print(f"{mx.default_device()}, vocab {args.vocab}, {dtype}, median of {args.iters}")
    for rows in args.rows:
        logits = (mx.random.normal((rows, args.vocab)) * 3).astype(dtype)
        mx.eval(logits)
        samplers = [smp.RowSampler(params) for _ in range(rows)]
        seeded = [smp.RowSampler(smp.SamplingParams(**{**params.__dict__, "seed": i}))
                  for i in range(rows)]
        plain = [smp.RowSampler(smp.SamplingParams(temperature=0.8)) for _ in range(rows)]
        nucleus = smp.SamplingParams(temperature=0.8, top_p=0.95)
        nucleus_rows = [smp.RowSampler(nucleus) for _ in range(rows)]
        reference = make_sampler(0.8, 0.95, top_k=50)
        nucleus_reference = make_sampler(0.8, 0.95)
        ids, x, limits = smp.filter_candidates(logits, [params] * rows)
        inv_temp = mx.array([1 / 0.8] * rows)
        mx.eval(ids, x, *limits, inv_temp)
        variants = {
            "greedy": lambda: mx.argmax(logits, axis=-1),
            "ours": lambda: smp.sample_batch(logits, samplers)[0],
            "ours, every row seeded": lambda: smp.sample_batch(logits, seeded)[0],
            "ours, temperature only": lambda: smp.sample_batch(logits, plain)[0],
            "mlx-lm": lambda: reference(logits - mx.logsumexp(logits, axis=-1, keepdims=True)),
            "  top-k candidates": lambda: smp._top_candidates(logits, 50),
            "  the draw among them": lambda: smp._pick(x, ids, *limits, inv_temp, None),
            "top-p alone, ours": lambda: smp.sample_batch(logits, nucleus_rows)[0],
            "  mlx-lm": lambda: nucleus_reference(
                logits - mx.logsumexp(logits, axis=-1, keepdims=True)),
        }
        timed: dict[str, float] = {}
        print(f"\n{rows} rows", flush=True)
        for name, fn in variants.items():
            for _ in range(10):
                mx.eval(fn())
            ts = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                mx.eval(fn())
                ts.append(time.perf_counter() - t0)
            timed[name] = ms = statistics.median(ts) * 1e3
            print(f"  {name:26s} {ms:7.3f} ms  {ms - timed['greedy']:+7.3f} ms over greedy",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
