#!/usr/bin/env python3
"""The timeline of a burst: N streams sent to our server at once, each stream's send, first and
last token (ms after the first send), run after run from a fresh server (the first run is its
first request), then raw mlx-lm's BatchGenerator on bursts of the same shape in this process
(in its environment: on a CPU, without the node's BLAS settings, so compare on a GPU). Tells
an aggregate rate's prefill part (the first tokens) from its decode part.

    python bench/diag_burst.py --random-llama 1b [--streams 8] [--tokens 64] [--runs 6]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_single_node import (  # noqa: E402
    SERVER_START_TIMEOUT,
    Server,
    add_model_args,
    ours_body,
    raw_mlx_lm,
    run_clients,
    select_model,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each stream")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--client-procs", type=int, default=4)
    args = ap.parse_args()
    if args.model is None and args.random_llama is None:
        args.random_llama = "small"
    work = Path(tempfile.mkdtemp(prefix="omlx-burst-"))
    model, _, _, config = select_model(args, work, dict(os.environ))
    rng = random.Random(7)
    vocab = int(config["vocab_size"])

    def burst() -> list[list[int]]:
        return [[rng.randrange(100, vocab - 1) for _ in range(32)] for _ in range(args.streams)]

    server = Server(model, work / "server.log", [])
    try:
        server.wait_ready(SERVER_START_TIMEOUT)
        url = server.base + "/v1/completions"
        for i in range(args.runs):
            streams = run_clients(url, [ours_body(p, args.tokens) for p in burst()],
                                  args.client_procs, work, 600)
            t0 = min(s["t0"] for s in streams)
            wall = max(s["end"] for s in streams) - t0

            def at(field: str) -> list[int]:
                return [round(1000 * (s[field] - t0)) for s in streams]  # noqa: B023

            print(f"ours, run {i}: {sum(s['tokens'] for s in streams) / wall:.0f} tok/s, wall "
                  f"{1000 * wall:.0f} ms; sent {at('t0')}, first token {at('t_first')}, last "
                  f"{at('t_last')}", flush=True)
    finally:
        server.stop()
    _, batch, _ = raw_mlx_lm(model, float("inf"))
    for i in range(args.runs):
        r = batch(burst(), args.tokens)
        print(f"raw BatchGenerator, run {i}: {r['agg_tps']:.0f} tok/s, wall "
              f"{1000 * r['wall']:.0f} ms, mean first token {1000 * r['ttft_mean']:.0f} ms",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
