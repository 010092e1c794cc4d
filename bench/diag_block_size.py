#!/usr/bin/env python3
"""What a smaller prefix-cache block costs: per block size, the time to store an agent turn's
prompt (the engine thread's cut, then the copier's move to host memory), to look it up and
restore it from RAM, and to write it to and restore it from the SSD tier (page cache warm), for
KV of a given shape. A smaller block reuses more of a re-sent conversation (at most
block_size - 1 tokens are prefilled again), at the price of more blocks, hashes and files.

    python bench/diag_block_size.py                              # SmolLM2-135M's KV, 3,352 tokens
    python bench/diag_block_size.py --layers 32 --kv-heads 8 --head-dim 128   # an 8B's

Prints a markdown table; results are committed by hand (bench/results/block_size_<tag>.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(block: int, args) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from omlx_node.kv_cache import PrefixCache

    n = args.tokens
    caches = []
    for _ in range(args.layers):
        c = KVCache()
        kv = mx.random.normal((1, args.kv_heads, n, args.head_dim))
        c.update_and_fetch(kv, kv + 1)
        caches.append(c)
    mx.eval([c.state for c in caches])
    rows: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        tokens = [rep * 100_000 + i for i in range(n)]
        with tempfile.TemporaryDirectory() as d:
            with PrefixCache("m", (0, args.layers), block, ssd_dir=d, dtype="float32") as pc:
                row = {"store (engine thread)": timed(lambda: pc.store(tokens, caches))}
                row["host copy (copier)"] = timed(pc._copier.settle)
                row["lookup"] = timed(lambda: pc.lookup(tokens))
                row["restore from RAM"] = timed(lambda: pc.restore(tokens, n))
                row["write to SSD (writer)"] = timed(lambda: pc.flush(120))
                files = len(list(Path(d).rglob("*.safetensors")))
            with PrefixCache("m", (0, args.layers), block, ssd_dir=d, dtype="float32",
                             hot_max_bytes=1) as pc:
                row["restore from SSD"] = timed(lambda: pc.restore(tokens, pc.lookup(tokens)))
        for k, v in row.items():
            rows.setdefault(k, []).append(v)
    out = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    out["files"] = files
    out["tokens lost at most"] = block - 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64, 256])
    ap.add_argument("--tokens", type=int, default=3352)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    res = {b: measure(b, args) for b in args.blocks}
    keys = list(next(iter(res.values())))
    print(f"KV of {args.layers} layers x {args.kv_heads} heads x {args.head_dim}, float32, "
          f"{args.tokens} tokens; ms, medians of {args.repeats}\n")
    print("| " + " | ".join(["block"] + keys) + " |")
    print("|" + " ---: |" * (len(keys) + 1))
    for b, r in res.items():
        print(f"| {b} | " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k])
                                       for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
