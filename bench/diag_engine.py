#!/usr/bin/env python3
"""Where does batch-1 decode time go? Peels our serving stack layer by layer on one model.

    A  mlx-lm generate_step                              (the reference)
    A8 mlx-lm BatchGenerator, 8 rows, decode phase       (the reference at 8 streams)
    B  our StageRunner + KVCache, generate_step's loop   (stage code)
    C  our StageRunner + a 1-row BatchKVCache            (+ the batched cache the batcher uses)
    D  our Batcher in-process, a consumer thread         (+ scheduler, events, metrics)
    E  a node agent process over gRPC                    (+ gRPC streaming, handler threads)
    F  the full server over HTTP/SSE                     (+ gateway: detokenize, SSE, uvicorn)

D, E and F also run 8 concurrent streams (decode-phase rate, every stream decoding).
Same dtype rules as the node (float32 and dequantized on a CPU). Writes JSON with --out.

    python bench/diag_engine.py --model PATH [--tokens 256] [--repeats 3] [--out FILE]
    python bench/diag_engine.py --random-llama-1b [--random-layers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_single_node as bsn  # noqa: E402


def rate(times: list[float], n: int | None = None) -> float | None:
    n = len(times) if n is None else n
    return (n - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


def measure(fn, repeats: int, warm_tokens: int, tokens: int) -> dict:
    fn(warm_tokens)
    runs = [fn(tokens) for _ in range(repeats)]
    return {"runs": runs, "median_tps": statistics.median([r for r in runs if r] or [0])}


def stage_loop(stage, prompt: list[int], n: int, batched: bool = False,
               phases: list[tuple[float, float]] | None = None) -> list[float]:
    """generate_step's loop (greedy, step n+1 scheduled before step n is read) over our
    StageRunner; `batched` decodes through a one-row BatchKVCache. Each token's arrival time;
    `phases` gets each step's (seconds building its graph, seconds then waiting for the token
    before it): a loop whose waits are ~0 is bound by its Python, not by the device."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    cache = stage.make_cache()
    stage(mx.array([prompt[:-1]]), cache, last_only=True)
    mx.eval([c.state for c in cache])
    if batched:
        cache = [BatchKVCache.merge([c]) for c in cache]
    nxt = mx.argmax(stage(mx.array([[prompt[-1]]]), cache)[:, -1, :], axis=-1)
    mx.async_eval(nxt)
    times = []
    for _ in range(n):
        y = nxt
        t0 = time.perf_counter()
        nxt = mx.argmax(stage(y[:, None], cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        t1 = time.perf_counter()
        y.tolist()
        times.append(time.perf_counter())
        if phases is not None:
            phases.append((t1 - t0, times[-1] - t1))
    return times


def in_process(model_path: Path, prompts: list[list[int]], tokens: int, repeats: int,
               warm: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load_model

    from omlx_node.batcher import Batcher, Finish, SeqRequest
    from omlx_node.metrics import NodeMetrics
    from omlx_node.stage import StageRunner

    out = {}
    model, _ = load_model(model_path)
    if mx.default_device() == mx.cpu:
        dequantize_model(model)
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    prompt = prompts[0]

    def a(n):
        times = []
        for _ in generate_step(mx.array(prompt), model, max_tokens=n,
                               prompt_cache=make_prompt_cache(model)):
            times.append(time.perf_counter())
        return rate(times)

    out["A_mlx_lm_generate_step"] = measure(a, repeats, warm, tokens)
    print("A", out["A_mlx_lm_generate_step"]["median_tps"], file=sys.stderr, flush=True)

    def a8(n):
        gen = BatchGenerator(model, max_tokens=n, completion_batch_size=32)
        uids = gen.insert(prompts[:8], max_tokens=[n] * 8)
        times: dict[int, list[float]] = {u: [] for u in uids}
        done = set()
        while len(done) < len(uids):
            for r in gen.next_generated():
                times[r.uid].append(time.perf_counter())
                if r.finish_reason is not None:
                    done.add(r.uid)
        gen.close()
        return bsn.steady_rate(list(times.values()))

    out["A8_mlx_lm_batch_generator"] = measure(a8, repeats, warm, tokens)
    print("A8", out["A8_mlx_lm_batch_generator"]["median_tps"], file=sys.stderr, flush=True)
    model = None  # its weights go before our stage loads its own (a and a8 are done with it)

    stage = StageRunner(model_path)

    def loop(n, batched: bool):
        return rate(stage_loop(stage, prompt, n, batched))

    out["B_stage_kvcache"] = measure(lambda n: loop(n, False), repeats, warm, tokens)
    print("B", out["B_stage_kvcache"]["median_tps"], file=sys.stderr, flush=True)
    out["C_stage_batchkvcache"] = measure(lambda n: loop(n, True), repeats, warm, tokens)
    print("C", out["C_stage_batchkvcache"]["median_tps"], file=sys.stderr, flush=True)

    batcher = Batcher(stage, NodeMetrics())
    counter = [0]

    def d(n, streams=1):
        seqs = []
        for i in range(streams):
            counter[0] += 1
            seqs.append(batcher.submit(SeqRequest(f"r{counter[0]}", prompts[i], n)))
        times: list[list[float]] = [[] for _ in seqs]

        def consume(i):
            while True:
                ev = seqs[i].events.get(timeout=60)
                if isinstance(ev, Finish):
                    return
                times[i].append(time.perf_counter())

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            batcher.step(block=False)
        for t in threads:
            t.join(5)
        return rate(times[0]) if streams == 1 else bsn.steady_rate(times)

    out["D_batcher_in_process"] = measure(d, repeats, warm, tokens)
    print("D", out["D_batcher_in_process"]["median_tps"], file=sys.stderr, flush=True)
    out["D8_batcher_in_process_8_streams"] = measure(lambda n: d(n, 8), repeats, warm, tokens)
    print("D8", out["D8_batcher_in_process_8_streams"]["median_tps"], file=sys.stderr, flush=True)
    return out


def over_grpc(model_path: Path, prompts: list[list[int]], tokens: int, repeats: int,
              warm: int, work: Path) -> dict:
    import grpc

    from proto import omlx_pb2 as pb
    from proto import omlx_pb2_grpc as pb_grpc

    with bsn.node_worker(model_path, work) as address, grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ShardWorkerStub(channel)
        counter = [0]

        def one(i, n, times):
            counter[0] += 1
            req = pb.GenerateRequest(request_id=f"g{counter[0]}-{i}", prompt_tokens=prompts[i],
                                     max_tokens=n, sampling=pb.SamplingParams())
            for chunk in stub.Generate(req, timeout=300):
                now = time.perf_counter()
                times.extend([now] * len(chunk.tokens))

        def e(n, streams=1):
            times = [[] for _ in range(streams)]
            threads = [threading.Thread(target=one, args=(i, n, times[i]))
                       for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            return rate(times[0]) if streams == 1 else bsn.steady_rate(times)

        out = {"E_node_over_grpc": measure(e, repeats, warm, tokens)}
        print("E", out["E_node_over_grpc"]["median_tps"], file=sys.stderr, flush=True)
        out["E8_node_over_grpc_8_streams"] = measure(lambda n: e(n, 8), repeats, warm, tokens)
        print("E8", out["E8_node_over_grpc_8_streams"]["median_tps"], file=sys.stderr, flush=True)
        return out


def over_http(model_path: Path, prompts: list[list[int]], tokens: int, repeats: int,
              warm: int, work: Path) -> dict:
    import httpx

    server = bsn.Server(model_path, work / "server.log", [])
    try:
        server.wait_ready(300)
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(timeout=300)

        def f(n, streams=1):
            async def go():
                return await asyncio.gather(*(bsn.stream_one(client, server.base, prompts[i], n)
                                              for i in range(streams)))
            res = loop.run_until_complete(go())
            return res[0]["decode_tps"] if streams == 1 else \
                bsn.steady_rate([r["times"] for r in res])

        out = {"F_full_server_http": measure(f, repeats, warm, tokens)}
        print("F", out["F_full_server_http"]["median_tps"], file=sys.stderr, flush=True)
        out["F8_full_server_http_8_streams"] = measure(lambda n: f(n, 8), repeats, warm, tokens)
        print("F8", out["F8_full_server_http_8_streams"]["median_tps"], file=sys.stderr, flush=True)
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        return out
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--warmup-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--in-process-only", action="store_true")
    args = ap.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-diag-"))
    work.mkdir(parents=True, exist_ok=True)
    model, _, _, config = bsn.select_model(args, work, dict(os.environ))
    vocab = config["vocab_size"]
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(32)] for _ in range(8)]
    warm = args.warmup_tokens or args.tokens
    result = {"model": str(model), "tokens": args.tokens, "repeats": args.repeats,
              "machine": bsn.machine_info()}
    # The in-process part runs in a child with the node's environment (same BLAS).
    from omlx_shared.blas import blas_env

    spec = work / "inproc.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "tokens": args.tokens,
                                "repeats": args.repeats, "warm": warm}))
    env = blas_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bsn.REPO), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, __file__, "--_inproc", str(spec)], env=env, check=True,
                   timeout=900)
    result.update(json.loads((work / "inproc.out.json").read_text()))
    if not args.in_process_only:
        result.update(over_grpc(model, prompts, args.tokens, args.repeats, warm, work))
        result.update(over_http(model, prompts, args.tokens, args.repeats, warm, work))
    print(f"{'layer':40s} {'tok/s':>10s} {'vs A':>7s}")
    base = result["A_mlx_lm_generate_step"]["median_tps"]
    for k, v in result.items():
        if isinstance(v, dict) and "median_tps" in v:
            print(f"{k:40s} {v['median_tps']:10.1f} {v['median_tps'] / base:7.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_inproc":
        s = json.loads(Path(sys.argv[2]).read_text())
        res = in_process(Path(s["model"]), s["prompts"], s["tokens"], s["repeats"], s["warm"])
        Path(sys.argv[2]).with_name("inproc.out.json").write_text(json.dumps(res))
        sys.exit(0)
    sys.exit(main())
