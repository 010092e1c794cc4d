#!/usr/bin/env python3
"""A fresh worker's first request against its next ones: time to first token over gRPC.

Each round starts a node with the model (`omlx-cluster node --model`), warms the client's
channel (three Health calls), then sends --requests greedy requests one after another and takes
each one's time to its first token. Prints, per round, the first request's TTFT and the median
of the others', and over the rounds the median of first / others. A worker that pays MLX's
first-use kernel builds while it loads (omlx_node/warm_up.py) has a ratio near 1; run the
script in a tree without it for the reference.

    python bench/diag_first_request.py [--model PATH | --random-llama small] [--rounds 5]
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

import bench_single_node as bsn  # noqa: E402


def one_round(model: Path, work: Path, requests: int, prompt: list[int]) -> list[float]:
    """A fresh worker's TTFTs, in seconds, of `requests` requests one after another."""
    import grpc

    from proto import omlx_pb2 as pb
    from proto import omlx_pb2_grpc as pb_grpc

    with bsn.node_worker(model, work) as address, grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ShardWorkerStub(channel)
        for _ in range(3):
            stub.Health(pb.HealthRequest(), timeout=30)
        ttfts = []
        for i in range(requests):
            t0, first = time.perf_counter(), None
            req = pb.GenerateRequest(request_id=f"r{i}", prompt_tokens=prompt, max_tokens=8)
            for chunk in stub.Generate(req, timeout=300):
                if first is None and chunk.tokens:
                    first = time.perf_counter() - t0
            ttfts.append(first)
        return ttfts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=5, help="fresh workers (default: 5)")
    ap.add_argument("--requests", type=int, default=5, help="requests a worker (default: 5)")
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp folder)")
    args = ap.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-first-request-"))
    model = bsn.select_model(args, work, dict(os.environ))[0]
    prompt = [5 + i % 300 for i in range(args.prompt_tokens)]
    ratios = []
    for r in range(args.rounds):
        ttfts = one_round(model, work, args.requests, prompt)
        rest = statistics.median(ttfts[1:])
        ratios.append(ttfts[0] / rest)
        print(f"round {r}: first {ttfts[0] * 1e3:.1f} ms, the others' median {rest * 1e3:.1f} ms "
              f"({', '.join(f'{t * 1e3:.1f}' for t in ttfts[1:])}), first / others "
              f"{ratios[-1]:.2f}", flush=True)
    print(f"median of first / others over {args.rounds} fresh workers: "
          f"{statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
