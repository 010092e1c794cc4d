#!/usr/bin/env python3
"""Sampled against greedy decode through the single-node engine, in process.

A batch of B rows (32 and 8) decodes `--tokens` tokens each, greedy (temperature 0) and then
sampled (temperature 0.8, top_p 0.95, top_k 50 or `--top-k`, 0 for top-p alone; unseeded). The
rate is decode tok/s: tokens streamed after every row's first one / time from the last first
token to the last token, so prefill is left out; and the same per second of the process's CPU
time. Each is the median of `--repeats` runs (greedy and sampled alternated) after a warm-up;
the ratio sampled/greedy is what the sampler costs (1.0: nothing). The process runs with the
BLAS a node's shard worker gets (omlx_shared.blas).

The model is a random llama with a large vocabulary and a small hidden size, so the head and the
sampler, not the layers, are most of a step: where sampling costs show.

    python -m bench.sampling [--vocab 65536] [--hidden 128] [--tokens 128] [--repeats 3]
                                   [--top-k 50] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from omlx_node.batcher import Batcher
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import Finish, SeqRequest
from omlx_node.stage import StageRunner
from omlx_shared.blas import blas_env
from tests.tiny_models import build_model

GREEDY = SamplingParams()
PROMPT_LEN = 16


def decode_rate(batcher: Batcher, rows: int, tokens: int,
                params: SamplingParams) -> tuple[float, float]:
    """Decode tokens per second of wall time and per second of this process's CPU time, of
    `rows` sequences decoding together, from the step after which every row had streamed its
    first token. CPU time is what a machine shared with other work still measures well."""
    seqs = [batcher.submit(SeqRequest(f"r{i}", [(7 * i + j) % 300 + 3 for j in range(PROMPT_LEN)],
                                      tokens, params))
            for i in range(rows)]
    start, cpu_start, streamed, seen = None, None, 0, set()
    while not batcher.idle:
        batcher.step()
        for s in seqs:
            while not s.events.empty():
                ev = s.events.get_nowait()
                if isinstance(ev, Finish):
                    continue
                if s in seen:
                    streamed += 1
                seen.add(s)
        if start is None and len(seen) == rows:
            start, cpu_start = time.perf_counter(), time.process_time()
    return (streamed / (time.perf_counter() - start),
            streamed / (time.process_time() - cpu_start))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--top-k", type=int, default=50, help="the sampled rows' top-k; 0: off")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the model's weights (so its logits): a GPU serves bfloat16")
    args = ap.parse_args()
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=args.top_k)
    env = blas_env()
    if env != dict(os.environ):  # the BLAS a node's shard worker runs with, preloaded at start
        os.execve(sys.executable, [sys.executable, "-m", "bench.sampling", *sys.argv[1:]], env)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "m", "llama", num_layers=args.layers,
                           hidden_size=args.hidden, extra_config={"vocab_size": args.vocab})
        if args.dtype != "float32":
            weights = path / "model.safetensors"
            mx.save_safetensors(str(weights), {k: v.astype(getattr(mx, args.dtype))
                                               for k, v in mx.load(str(weights)).items()})
        batcher = Batcher(StageRunner(path), NodeMetrics(), max_batch=max(args.batches))
        print(f"machine: {platform.machine()}, model: random llama, vocab {args.vocab}, hidden "
              f"{args.hidden}, {args.layers} layers, {args.dtype}; {args.tokens} tokens a row; "
              f"sampled: temperature 0.8, top-p 0.95, top-k {args.top_k or 'off'}; median of "
              f"{args.repeats}")
        print("| rows | greedy tok/s | sampled tok/s | sampled/greedy | greedy tok/CPU-s | "
              "sampled tok/CPU-s | sampled/greedy (CPU) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rows in args.batches:
            modes = {"greedy": GREEDY, "sampled": sampled}
            for params in modes.values():
                decode_rate(batcher, rows, 8, params)  # warm-up: this batch size's kernels
            # Alternated, so that load from elsewhere on a shared machine hits both alike.
            runs = [{name: decode_rate(batcher, rows, args.tokens, params)
                     for name, params in modes.items()} for _ in range(args.repeats)]
            wall, cpu = ({name: statistics.median(r[name][m] for r in runs) for name in modes}
                         for m in (0, 1))
            print(f"| {rows} | {wall['greedy']:.0f} | {wall['sampled']:.0f} | "
                  f"{wall['sampled'] / wall['greedy']:.2f} | {cpu['greedy']:.0f} | "
                  f"{cpu['sampled']:.0f} | {cpu['sampled'] / cpu['greedy']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
