#!/usr/bin/env python3
"""Time to first token of a long prompt at batch 1: our engine against raw mlx-lm prefill.

For each prompt length (default 2048 and 8192 tokens), medians of --repeats runs after a warm-up,
each run on a fresh random prompt (so the prefix cache misses and stores it, as a first request
does):

- raw mlx-lm, in-process: `generate_step(prompt)` call -> first yielded token (its prefill in
  2048-token steps, then the first sample; the goal's reference);
- ours, in-process: `Batcher.submit` -> first token on the sequence's stream, the engine stepped
  on this thread, with the prefix cache on (RAM 1 GiB + SSD tier in a temp dir, as `serve`
  defaults) and off; plus "cache hit": the last prompt again, its blocks restored (from the
  device tier where `serve` turns it on, a CUDA GPU), and "hit, RAM only": the same from the
  RAM tier, on an engine without the device tier; plus
  "serial": ours with every prompt chunk waited for and a first token streamed after the next
  step is built, as generate_step does (our engine before 2026-12-02, the reference of its
  first-token overlaps);
- with --http: first SSE token of a streamed /v1/completions through our server
  (`python -m omlx_cluster serve`) with the cache on and off, both up at once and their
  requests interleaved (a host's drift then hits them alike), plus "on, spaced": the cache-on
  server's requests each after `--pause` s idle, so the previous prompt's store is done; then
  through `mlx_lm.server`.

The in-process sides run interleaved in one process (raw, ours on, ours off, serial, per
repeat), so drift on a shared machine hits them alike. After each run with the cache on, the bench
waits for the SSD writer to finish (`PrefixCache.flush`), so a run never pays for the previous run's
writes.

    python -m bench.ttft                          # CPU: a small random llama, minutes
    python -m bench.ttft --random-llama 8b        # GPU: Llama-3-8B layers, bf16
    python -m bench.ttft --random-llama 8b --http

Writes bench/results/ttft-<tag>.md and .json (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    LLAMA8B,
    RESULTS,
    TINYLLAMA,
    MlxLmServer,
    Server,
    machine_info,
    write_random_llama,
)

# Small enough that an 8192-token prefill takes seconds on a 2-core CPU, wide enough that it is
# matmul work rather than Python overhead.
SMALL = dict(hidden_size=384, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, intermediate_size=1024, vocab_size=32000)
SHAPES = {"small": SMALL, "1b": TINYLLAMA, "8b": LLAMA8B}
CONTEXT = 32768  # the random llama's context: the longest prompt a run (or a reused folder) takes


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- the in-process sides -----------------------------------------------------------------------


class Raw:
    """mlx-lm's own single-sequence path, in the node's compute dtype (as omlx_node.stage)."""

    def __init__(self, model_path: Path):
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model, load_model

        self.mx = mx
        self.model, _ = load_model(model_path)
        if mx.default_device() == mx.cpu:
            dequantize_model(self.model)
            self.model.set_dtype(mx.float32)
        mx.eval(self.model.parameters())

    def ttft(self, prompt: list[int]) -> float:
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        t0 = time.perf_counter()
        cache = make_prompt_cache(self.model)
        gen = generate_step(self.mx.array(prompt), self.model, max_tokens=2, prompt_cache=cache)
        next(gen)
        t = time.perf_counter() - t0
        for _ in gen:
            pass
        return t


def make_serial(engine) -> None:
    """Our engine as it was before its first-token overlaps, the reference they are measured
    against: a prompt's last chunk waited for before the first step is built, and a first token
    streamed only after the step after it is built, as every other token."""
    prefill = engine.state.prefill
    engine.state.prefill = lambda seq_id, x, wait=True: prefill(seq_id, x)

    def decode_step() -> None:
        y, records, failed = engine._y, engine._records, engine._failed
        engine._hand_out(y, records, failed, engine._launch(y))

    engine._decode_step = decode_step


class Ours:
    """Our single-node engine, stepped on this thread as the worker's main loop steps it."""

    def __init__(self, stage, cache_dir: Path | None, prefill_chunk: int | None,
                 serial: bool = False, device_tier: bool = True):
        """`serial`: the engine without its first-token overlaps (`make_serial`).
        `device_tier`: the prefix cache's device tier as `serve` sizes it, else none."""
        from omlx_node.batcher import Batcher
        from omlx_node.kv_cache import PrefixCache
        from omlx_node.kv_cache.device_tier import default_max_bytes
        from omlx_node.metrics import NodeMetrics

        metrics = NodeMetrics()
        self.cache = None
        if cache_dir is not None:
            info = stage.info
            self.cache = PrefixCache("bench", (info.layer_start, info.layer_end), 256,
                                     hot_max_bytes=1 << 30, ssd_dir=cache_dir,
                                     ssd_max_bytes=16 << 30, metrics_registry=metrics.registry,
                                     dtype=info.dtype,
                                     device_max_bytes=default_max_bytes() if device_tier else 0)
        chunk = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        self.engine = Batcher(stage, metrics, prefix_cache=self.cache, **chunk)
        if serial:
            make_serial(self.engine)

    def ttft(self, prompt: list[int]) -> float:
        from omlx_node.sequence import Finish, SeqRequest

        t0 = time.perf_counter()
        seq = self.engine.submit(SeqRequest(request_id=f"r{t0}", prompt=prompt, max_tokens=2))
        first = None
        while True:
            self.engine.step()
            while not seq.events.empty():
                event = seq.events.get()
                if isinstance(event, Finish):
                    if event.reason not in ("stop", "length"):
                        raise RuntimeError(f"the request ended with {event}")
                    if self.cache is not None:
                        self.cache.flush(60.0)
                    return first
                if first is None:
                    first = time.perf_counter() - t0

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


def measure_in_process(model_path: Path, lengths: list[int], repeats: int,
                       prefill_chunk: int | None, work: Path) -> dict:
    from omlx_node.stage import StageRunner

    raw = Raw(model_path)
    stage = StageRunner(model_path)
    on = Ours(stage, work / "kv-cache", prefill_chunk)
    off = Ours(stage, None, prefill_chunk)
    serial = Ours(stage, work / "kv-cache-2", prefill_chunk, serial=True)
    ram = Ours(stage, work / "kv-cache-3", prefill_chunk, device_tier=False)
    sides = {"raw": raw.ttft, "ours_cache_on": on.ttft, "ours_cache_off": off.ttft,
             "ours_serial": serial.ttft}
    rng = random.Random(1234)
    out: dict = {"prefill_chunk": on.engine.prefill_chunk}
    try:
        for n in lengths:
            def prompt() -> list[int]:
                return [rng.randrange(100, 31000) for _ in range(n)]

            for fn in sides.values():  # warm-up: kernels of these shapes, allocator pools
                fn(prompt())
            ram.ttft(prompt())
            runs: dict[str, list[float]] = {
                k: [] for k in [*sides, "ours_cache_hit", "ours_cache_hit_ram"]}
            for _ in range(repeats):
                p = prompt()
                for name, fn in sides.items():
                    runs[name].append(fn(p if name == "ours_cache_on" else prompt()))
                runs["ours_cache_hit"].append(on.ttft(p))
                ram.ttft(p)  # stored, then its hit without the device tier
                runs["ours_cache_hit_ram"].append(ram.ttft(p))
            out[str(n)] = {k: {"runs": v, "median_s": median(v)} for k, v in runs.items()}
            print(f"  {n} tokens: " + ", ".join(f"{k} {median(v) * 1e3:.1f} ms"
                                                for k, v in runs.items()),
                  file=sys.stderr, flush=True)
    finally:
        on.close()
        serial.close()
        ram.close()
    return out


# ---- the HTTP sides -----------------------------------------------------------------------------


async def first_sse(client, base: str, model: str, prompt: str) -> float:
    """A streamed greedy /v1/completions of a text prompt: seconds to its first text event."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - t0
    return first


def measure_http(servers: dict[str, tuple[object, str]], lengths: list[int], repeats: int,
                 seed: int, pause: float = 0.0) -> dict:
    """First SSE tokens of fresh prompts from each of `servers` (name -> (server, the model
    name it takes)), interleaved per repeat in an order that alternates, so a host's drift hits
    them alike. A name ending in "_spaced" is sent after `pause` seconds of nothing (the
    previous request's store then done) to the server of the name without it."""
    import httpx

    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
    out: dict = {name: {} for name in servers}
    try:
        for n in lengths:
            def prompt() -> str:
                return " ".join(f"t{rng.randrange(100, 31000)}" for _ in range(n))

            def one(name: str) -> float:
                server, model = servers[name]
                if name.endswith("_spaced"):
                    time.sleep(pause)
                return loop.run_until_complete(first_sse(client, server.base, model, prompt()))

            for name in servers:  # warm-up: kernels of this length
                one(name)
            runs: dict[str, list[float]] = {name: [] for name in servers}
            order = list(servers)
            for k in range(repeats):
                for name in order if k % 2 == 0 else reversed(order):
                    runs[name].append(one(name))
            for name, v in runs.items():
                out[name][str(n)] = {"runs": v, "median_s": median(v)}
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    return out


def measure_servers(model_path: Path, lengths: list[int], repeats: int, work: Path,
                    pause: float) -> dict:
    """Our server with the cache on and off, both up at once and measured interleaved (plus
    "on, spaced": each request after `pause` s idle); then mlx_lm.server."""
    ours = {"ours_cache_on": ["--paged-ssd-cache-dir", str(work / "srv-kv")],
            "ours_cache_off": ["--hot-cache-max-size", "0"]}
    servers = {name: Server(model_path, work / f"{name}.log", extra)
               for name, extra in ours.items()}
    try:
        for server in servers.values():
            server.wait_ready(600)
        sides = {name: (server, "bench") for name, server in servers.items()}
        sides["ours_cache_on_spaced"] = sides["ours_cache_on"]
        out = measure_http(sides, lengths, repeats, seed=1, pause=pause)
    finally:
        for server in servers.values():
            server.stop()
    print(f"  http ours: {out}", file=sys.stderr, flush=True)
    server = MlxLmServer(model_path, work / "mlx_lm_server.log", [])
    try:
        server.wait_ready(600)
        # mlx_lm.server takes the request's model as a path to load: the folder it serves.
        out |= measure_http({"mlx_lm_server": (server, str(model_path))}, lengths, repeats,
                            seed=9)
    finally:
        server.stop()
    return out


# ---- report -------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lines = [f"# TTFT of a long prompt at batch 1: ours vs raw mlx-lm prefill ({result['tag']})",
             "", f"- machine: {result['machine']}", f"- model: {result['model']}",
             f"- mlx {result['mlx']}, mlx-lm {result['mlx_lm']}, device `{result['device']}`, "
             f"compute dtype {result['dtype']}",
             f"- our prefill chunk: {result['in_process']['prefill_chunk']} tokens; medians of "
             f"{result['repeats']} runs after a warm-up, a fresh random prompt per run", "",
             "| prompt | raw mlx-lm | ours, cache on | ratio | ours, cache off | ratio "
             "| ours, cache hit | hit, RAM only | ours, serial (cache on) | ratio |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ip = result["in_process"]
    for n in result["lengths"]:
        r = {k: v["median_s"] for k, v in ip[str(n)].items()}
        lines.append(f"| {n} | {r['raw'] * 1e3:.1f} ms | {r['ours_cache_on'] * 1e3:.1f} ms | "
                     f"{r['ours_cache_on'] / r['raw']:.2f}x | {r['ours_cache_off'] * 1e3:.1f} ms"
                     f" | {r['ours_cache_off'] / r['raw']:.2f}x | "
                     f"{r['ours_cache_hit'] * 1e3:.1f} ms | "
                     + (f"{r['ours_cache_hit_ram'] * 1e3:.1f} ms | " if "ours_cache_hit_ram" in r
                        else "| ")
                     + (f"{r['ours_serial'] * 1e3:.1f} ms | "
                        f"{r['ours_serial'] / r['raw']:.2f}x |" if "ours_serial" in r
                        else "| |"))
    lines += ["", "Ratio: our TTFT / raw mlx-lm's (goal <= 1.1). In-process: `generate_step` "
              "call -> first token against `Batcher.submit` -> first token on its stream. "
              "Serial: our engine without its first-token overlaps (each prompt chunk waited "
              "for, a first token streamed after the next step is built: generate_step's "
              "order, and ours before). Cache hit: the last cache-on prompt again, its blocks "
              "restored (on a CUDA GPU from the device tier); RAM only: the same without the "
              "device tier, blocks from the RAM tier."]
    http = result.get("http")
    if http:
        lines += ["", "HTTP, first SSE token of a streamed /v1/completions (ours: both servers "
                  "up at once, requests interleaved; spaced: each after "
                  f"{result.get('pause', 1.0):g} s idle):", "",
                  "| prompt | ours, cache on | on, spaced | ours, cache off | mlx_lm.server "
                  "| on / mlx_lm | off / mlx_lm |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n in result["lengths"]:
            r = {k: v[str(n)]["median_s"] for k, v in http.items()}
            spaced = r.get("ours_cache_on_spaced")
            lines.append(f"| {n} | {r['ours_cache_on'] * 1e3:.1f} ms | "
                         + (f"{spaced * 1e3:.1f} ms" if spaced else "")
                         + f" | {r['ours_cache_off'] * 1e3:.1f} ms | "
                         f"{r['mlx_lm_server'] * 1e3:.1f} ms"
                         f" | {r['ours_cache_on'] / r['mlx_lm_server']:.2f}x | "
                         f"{r['ours_cache_off'] / r['mlx_lm_server']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-llama", choices=sorted(SHAPES), default="small",
                    help="shape of the random llama (default: small, for a CPU; 8b on a GPU)")
    ap.add_argument("--random-layers", type=int, default=None, help="override its layer count")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="build the random llama there, or reuse the one already there "
                         "(default: a temp dir)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="our engine's prefill chunk (default: the engine's default)")
    ap.add_argument("--http", action="store_true",
                    help="also time our HTTP server and mlx_lm.server")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="with --http: seconds idle before each 'spaced' request (default: 1)")
    ap.add_argument("--machine", help="how the report names the machine")
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if max(args.lengths) + 2 > CONTEXT:
        ap.error(f"prompts longer than {CONTEXT - 2} tokens exceed the random llama's context")

    from omlx_shared.blas import blas_env

    env = blas_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        # The library must be loaded when the process starts, as a shard worker's is.
        os.execve(sys.executable, [sys.executable, "-m", "bench.ttft", *sys.argv[1:]], env)

    import mlx.core as mx
    import mlx_lm

    info = machine_info()
    on_gpu = mx.default_device() != mx.cpu
    tag = args.tag or (("h200" if "H200" in info["gpu"] else "gpu") if on_gpu else "cpu")
    shape = SHAPES[args.random_llama]
    layers = args.random_layers or shape["num_hidden_layers"]
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        work = Path(tmp)
        model = args.model_dir or work / "model"
        if not (model / "config.json").exists():
            write_random_llama(model, shape, "bfloat16", args.random_layers, CONTEXT)
            print(f"model built in {model}", file=sys.stderr, flush=True)
        result = {
            "tag": tag, "lengths": args.lengths, "repeats": args.repeats,
            "machine": args.machine or info["gpu"] or f"{info['cpu_count']}-core {info['cpu']}",
            "model": f"random llama, {args.random_llama} shape (hidden {shape['hidden_size']}, "
                     f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} kv, "
                     f"intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}), "
                     f"{layers} layers",
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device()), "dtype": "float32" if not on_gpu else "bfloat16",
            "git_commit": info.get("git_commit"), "pause": args.pause,
        }
        result["in_process"] = measure_in_process(model, args.lengths, args.repeats,
                                                  args.prefill_chunk, work)
        write(result, args.out)  # kept should the HTTP sides fail
        if args.http:
            result["http"] = measure_servers(model, args.lengths, args.repeats, work,
                                             args.pause)
            write(result, args.out)
    print(markdown(result))
    return 0


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ttft-{result['tag']}.json").write_text(json.dumps(result, indent=2))
    (out / f"ttft-{result['tag']}.md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
