#!/usr/bin/env python3
"""Where a prefix-cache store and restore spend their time on this device, piece by piece.

On an H200 a cache hit took longer than prefilling the prompt again (bench_ttft: the 8B at 8192
tokens, 1366 ms against 246), and a fresh prompt's first token is slower with the cache on than
off. MLX on CUDA allocates managed memory: a buffer the host reads or writes moves there page by
page, and back when the device next touches it. This diagnostic times each piece of the cache's
path on one prompt's mlx-lm KVCaches, in the order the engine runs them:

- prefill: the prompt in 2048-token chunks (the node's default chunk), evaluated;
- decode steps before any store (the baseline), a median of --steps;
- cut: `blocks.cut_spans` of every full block, on this thread (the engine thread's share);
- host copy: `blocks.host_blocks` on a second thread (the copier's share), with this thread
  decoding meanwhile (do the device's steps slow while pages move?) and after it;
- restore, each followed by one decode step over what it restored (first device touch):
  - blocks: `blocks.build_caches` from the host blocks (the cache's path today);
  - spans, host-read: device slices of the cut the host copy read;
  - spans, fresh: device slices of a second cut that no host thread has read.

Medians over --repeats fresh random prompts per length; every run in the JSON.

    python bench/diag_kv_device.py                          # CPU: a tiny llama
    python bench/diag_kv_device.py --random-llama 8b        # GPU

Writes bench/results/diag_kv_device_<tag>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_single_node import diag_model, machine_info  # noqa: E402

BLOCK = 256
CHUNK = 2048


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-llama", choices=["1b", "8b"],
                    help="a random-weight llama of that shape (default: a tiny test llama)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per median")
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.utils import load_model

    info = machine_info()
    on_gpu = mx.default_device() != mx.cpu
    tag = args.tag or (("h200" if "H200" in (info["gpu"] or "") else "gpu") if on_gpu else "cpu")
    with tempfile.TemporaryDirectory(prefix="diag-kv-") as tmp:
        path, vocab = diag_model(Path(tmp), args.random_llama, max(args.lengths) + 64,
                                 num_layers=4)
        model, _ = load_model(path)
        if not on_gpu:
            model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        rows = {n: [run_once(model, n, vocab, args.steps) for _ in range(args.repeats + 1)][1:]
                for n in args.lengths}  # the first run of each length warms its kernels up
    result = {"tag": tag, "machine": info["gpu"] or f"{info['cpu_count']}-core {info['cpu']}",
              "model": args.random_llama or "tiny llama, 4 layers", "mlx": mx.__version__,
              "git_commit": info.get("git_commit"), "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"diag_kv_device_{tag}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"diag_kv_device_{tag}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def run_once(model, n: int, vocab: int, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from omlx_node.kv_cache.blocks import BY_MX, build_caches, cut_spans, host_blocks

    prompt = [random.randrange(10, vocab) for _ in range(n)]
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for i in range(0, n, CHUNK):
        model(mx.array(prompt[i:i + CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out = {"prefill_ms": ms(t0)}
    token = mx.array([[prompt[-1]]])
    out["step_base_ms"] = decode_steps(model, token, cache, steps)

    dt = BY_MX[cache[0].keys.dtype]
    todo = list(range(n // BLOCK))
    hashes = [f"{i:064x}" for i in todo]
    t0 = time.perf_counter()
    spans = cut_spans(cache, todo, BLOCK, dt)
    out["cut_ms"] = ms(t0)

    copied: dict = {}

    def copy() -> None:
        t = time.perf_counter()
        copied["blocks"] = host_blocks(spans, hashes, todo, BLOCK, dt)
        copied["ms"] = ms(t)

    thread = threading.Thread(target=copy)
    thread.start()
    during = []
    while thread.is_alive() and len(during) < 500:
        during.append(timed_step(model, token, cache))
    thread.join()
    out["host_copy_ms"] = copied["ms"]
    out["steps_during_copy"] = len(during)
    out["step_during_copy_ms"] = statistics.median(during) if during else None
    out["step_after_copy_ms"] = decode_steps(model, token, cache, steps)

    n_layers = len(cache)

    def from_spans(cut) -> list:
        parts: list = [None] * (2 * n_layers)
        for stack, idx in cut:
            for j, i in enumerate(idx):
                parts[i] = stack[j]
        caches = []
        for layer in range(n_layers):
            c = KVCache()
            pair = []
            for a in parts[2 * layer: 2 * layer + 2]:
                heads, _, dim = a.shape
                full = mx.concatenate([a[None], mx.zeros((1, heads, KVCache.step, dim), a.dtype)],
                                      axis=2)
                pair.append(full.view(dt.mx) if dt.mx == mx.bfloat16 else full)
            c.keys, c.values = pair
            c.offset = len(todo) * BLOCK
            caches.append(c)
        mx.eval([c.state for c in caches])
        return caches

    restores = {
        "blocks": lambda: build_caches(copied["blocks"], n_layers, BLOCK),
        "spans_host_read": lambda: from_spans(spans),
        "spans_fresh": lambda: from_spans(cut_spans(cache, todo, BLOCK, dt)),
    }
    for name, restore in restores.items():
        t0 = time.perf_counter()
        restored = restore()
        out[f"restore_{name}_ms"] = ms(t0)
        out[f"step_after_restore_{name}_ms"] = timed_step(model, token, restored)
    t0 = time.perf_counter()
    fresh = make_prompt_cache(model)
    for i in range(0, n, CHUNK):
        model(mx.array(prompt[i:i + CHUNK])[None], cache=fresh)
        mx.eval([c.state for c in fresh])
    out["prefill_after_ms"] = ms(t0)
    out["kv_mib"] = sum(b.nbytes for b in copied["blocks"]) / (1 << 20)
    print(json.dumps({"tokens": n, **out}), file=sys.stderr, flush=True)
    return out


def timed_step(model, token, cache) -> float:
    import mlx.core as mx

    t0 = time.perf_counter()
    mx.eval(model(token, cache=cache))
    return ms(t0)


def decode_steps(model, token, cache, steps: int) -> float:
    return statistics.median(timed_step(model, token, cache) for _ in range(steps))


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def markdown(result: dict) -> str:
    keys = ["prefill_ms", "step_base_ms", "cut_ms", "host_copy_ms", "step_during_copy_ms",
            "step_after_copy_ms", "restore_blocks_ms", "step_after_restore_blocks_ms",
            "restore_spans_host_read_ms", "step_after_restore_spans_host_read_ms",
            "restore_spans_fresh_ms", "step_after_restore_spans_fresh_ms", "prefill_after_ms"]
    lines = [f"# Prefix-cache store and restore, piece by piece ({result['machine']})", "",
             f"`bench/diag_kv_device.py`, model {result['model']}, mlx {result['mlx']}, "
             f"commit {result['git_commit']}. Medians over runs (ms).", "",
             "| piece | " + " | ".join(f"{n} tokens" for n in result["runs"]) + " |",
             "| --- |" + " ---: |" * len(result["runs"])]
    for k in ["kv_mib", *keys]:
        vals = []
        for runs in result["runs"].values():
            xs = [r[k] for r in runs if r.get(k) is not None]
            vals.append(f"{statistics.median(xs):.1f}" if xs else "-")
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
