#!/usr/bin/env python3
"""Pipeline benchmark: N local stages over mx.distributed against one stage, on the same model,
in one run, with ratios.

Measures, each as a median of --repeats timed runs after warm-ups:

1. batch-1 decode tok/s through the HTTP streaming API (token-id prompt, ignore_eos, greedy;
   rate from the first to the last streamed token) of `serve --nodes 2` against `--nodes 1`.
2. the data plane's per-hop latency: two processes joined by an mx.distributed ring on loopback
   (MLX_RANK / MLX_HOSTFILE, `mx.distributed.init(backend="ring", strict=True)`) exchange a
   decode step exactly as the pipeline does (`omlx_node.wire.send_step` of a DECODE header,
   its payload and a hidden state of the model's size one way, `send_tokens` back); the
   round trip's median over many iterations, one way ~= rtt / 2. Also: a header-only ping-pong
   (the per-message floor) and hidden states of 16 / 32 rows (the micro-batch sizes below).
3. aggregate tok/s at 16 and 32 concurrent streams (completion tokens / wall time from the first
   request sent to the last stream finished, prefill included) of the 2-stage pipeline with
   K = stages micro-batches in flight against K = 1 (`--micro-batches 1`, the lockstep
   pipeline), same prompts and max_tokens; the single stage is measured too.
4. the same for every pipeline length of --stages (e.g. `--stages 2 4`), each with the default
   (as many micro-batches as pay off), K = stages always, and K = 1;
5. with one GPU per stage (OMLX_NODE_DEVICES) and nvidia-smi present: each stage's busy
   fraction, nvidia-smi's `utilization.gpu` (share of time a kernel ran) sampled every 100 ms
   over the middle half of each concurrent batch.

Every server runs alone (`python -m omlx_cluster serve --nodes N ...`), warmed up with one
full-length request at batch 1 and one full-length batch at every concurrency level (on a GPU the
first call of each shape JIT-compiles) before anything is timed. On a multi-GPU host set
OMLX_NODE_DEVICES=0,1 so each stage (and each rank of the hop test) gets its own GPU.

    python -m bench.pipeline                               # the default model, CPU-sized
    OMLX_NODE_DEVICES=0,1 python -m bench.pipeline --random-llama-1b --repeats 5 \\
        --decode-tokens 256 --conc-tokens 256 --warmup-tokens 256
    # the 4-GPU scaling run: 1, 2 and 4 stages, 8 / 32 / 64 streams, busy fraction per GPU
    OMLX_NODE_DEVICES=0,1,2,3 python -m bench.pipeline --random-llama 8b --stages 2 4 \\
        --concurrency 8 32 64 --repeats 3 --decode-tokens 64 --conc-tokens 64

Results: bench/results/pipeline-<tag>.json and .md (tag: cpu, h200, h200x2, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from bench.common import (
    RESULTS,
    Server,
    add_model_args,
    blas_of,
    free_port,
    machine_info,
    median,
    select_model,
    stream_batch,
    stream_one,
    with_repo_path,
)

SERVER_START_TIMEOUT = 240.0


# ---- the data-plane micro-benchmark (two ring ranks) --------------------------------------------


def hop_rank(spec: dict) -> dict:
    """One rank of the hop test. Rank 0 sends each case's decode step (header, payload, hidden)
    to rank 1 and times until rank 1's sampled tokens come back; rank 1 consumes the hidden on
    its default device (as a stage's layers would) and answers with int32[rows] tokens, until a
    STOP step. The cases are interleaved in rounds, so drift and neighbours' load hit them alike."""
    import mlx.core as mx
    from omlx_node import wire
    from omlx_node.stage import compute_dtype

    deadline = time.monotonic() + spec["timeout"]
    t = time.perf_counter()
    group = mx.distributed.init(backend="ring", strict=True)
    init_s = time.perf_counter() - t
    rank = group.rank()
    assert group.size() == 2, group.size()
    hsize = spec["hidden_size"]
    dtype = compute_dtype(getattr(mx, spec["dtype"]))
    plan = 0x5EED
    out = {"rank": rank, "init_s": init_s, "device": str(mx.default_device()),
           "dtype": str(dtype).removeprefix("mlx.core."), "cases": []}
    if rank == 1:
        while True:
            step, hidden = wire.recv_step(plan, 0, group, hsize, dtype)
            if step.op == wire.STOP:
                return out
            if hidden is not None:
                tok = mx.argmax(hidden[:, -1, :64], axis=-1).astype(mx.int32)
            else:
                tok = mx.zeros((1,), dtype=mx.int32)
            wire.send_tokens(tok, 0, group)

    cases = spec["cases"]
    bases = []
    for case in cases:
        b = mx.random.normal((max(case["rows"], 1), case["tokens"], hsize)).astype(dtype)
        mx.eval(b)
        bases.append(b)

    def one(case: dict, base: mx.array, i: int) -> float:
        if time.monotonic() > deadline:
            raise TimeoutError("the hop test ran past its time limit")
        if case["mode"] == "header":
            step, h = wire.Step(wire.FREE), None
        else:
            step = wire.Step(wire.DECODE, step=i, target=0, rows=case["rows"],
                             tokens=case["tokens"])
            # "lazy": produced by a (trivial) op on the default device, like a stage's output,
            # so the send includes waiting for that device; "ready": already evaluated.
            h = base + (i & 1) if case["mode"] == "lazy" else base
        t0 = time.perf_counter()
        wire.send_step(step, h, plan, 1, group)
        if case.get("flush"):
            wire.flush()
        toks = wire.recv_tokens(max(case["rows"], 1), 1, group)
        dt = time.perf_counter() - t0
        assert len(toks) == max(case["rows"], 1)
        return dt

    for i in range(spec["warmup"]):  # the whole schedule once, untimed
        for case, base in zip(cases, bases):
            one(case, base, i)
    rounds = max(1, spec.get("rounds", 5))
    per = max(1, spec["iters"] // rounds)
    rtts: list[list[float]] = [[] for _ in cases]
    for r in range(rounds):
        for j, (case, base) in enumerate(zip(cases, bases)):
            rtts[j] += [one(case, base, i) for i in range(per)]
    wire.send_step(wire.Step(wire.STOP), None, plan, 1, group)
    for case, rs in zip(cases, rtts):
        r = sorted(rs)
        q = lambda f: r[min(len(r) - 1, int(f * len(r)))]  # noqa: E731
        nbytes = case["rows"] * case["tokens"] * hsize * dtype.size \
            if case["mode"] != "header" else 0
        out["cases"].append({**case, "hidden_bytes": nbytes, "iters": len(r),
                             "rtt_median_us": statistics.median(r) * 1e6,
                             "rtt_p10_us": q(0.1) * 1e6, "rtt_p90_us": q(0.9) * 1e6,
                             "rtt_min_us": r[0] * 1e6,
                             "one_way_us": statistics.median(r) * 1e6 / 2})
    return out


def hop_bench(hidden_size: int, dtype: str, args, node_env: dict, work: Path) -> dict:
    """Starts the two ranks and waits for both, bounded by a timeout."""
    ports = [free_port(), free_port()]
    hostfile = work / "hop_hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    cases = [{"name": "header only (int32[64]) + token back", "rows": 0, "tokens": 1,
              "mode": "header"},
             {"name": "decode step, 1 row, hidden evaluated", "rows": 1, "tokens": 1,
              "mode": "ready"},
             {"name": "decode step, 1 row, hidden from a device op", "rows": 1, "tokens": 1,
              "mode": "lazy"},
             {"name": "decode step, 1 row, hidden from a device op, sender waits for its send "
                      "(synchronous sends)", "rows": 1, "tokens": 1, "mode": "lazy",
              "flush": True}]
    for rows in args.hop_rows:
        cases.append({"name": f"decode step, {rows} rows, hidden from a device op", "rows": rows,
                      "tokens": 1, "mode": "lazy"})
    spec = {"hidden_size": hidden_size, "dtype": dtype, "cases": cases, "iters": args.hop_iters,
            "warmup": args.hop_warmup, "rounds": 5, "timeout": args.hop_timeout}
    spec_file = work / "hop.in.json"
    spec_file.write_text(json.dumps(spec))
    devices = [d for d in os.environ.get("OMLX_NODE_DEVICES", "").split(",") if d]
    procs, results = [], []
    for rank in range(2):
        env = with_repo_path(node_env)
        env["MLX_RANK"], env["MLX_HOSTFILE"] = str(rank), str(hostfile)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[rank % len(devices)]
        res = work / f"hop.{rank}.out.json"
        log = open(work / f"hop.{rank}.log", "wb")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "bench.pipeline", "--_child", "hop", "--_spec",
             str(spec_file), "--_result", str(res)], env=env, stdout=log,
            stderr=subprocess.STDOUT), res, log))
    deadline = time.monotonic() + args.hop_timeout + 30
    errors = []
    for rank, (p, res, log) in enumerate(procs):
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            errors.append(f"rank {rank} timed out")
        log.close()
        if p.returncode == 0 and res.exists():
            results.append(json.loads(res.read_text()))
        else:
            tail = (work / f"hop.{rank}.log").read_text(errors="replace")[-3000:]
            errors.append(f"rank {rank} exit {p.returncode}:\n{tail}")
    if errors:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
        return {"error": "\n".join(errors), "cases": []}
    r0 = next(r for r in results if r["rank"] == 0)
    return {"cases": r0["cases"], "device": r0["device"], "dtype": r0["dtype"],
            "init_s": [r["init_s"] for r in results], "hidden_size": hidden_size,
            "devices": devices or None}


# ---- servers ------------------------------------------------------------------------------------


def make_prompts(vocab: int, args, seed: int = 4321) -> dict:
    """The same prompts for every configuration: index 0..warmups-1 are the warm-ups'."""
    rng = random.Random(seed)
    hi = vocab - 1
    lo = min(100, hi // 2)

    def prompt() -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]

    n = args.warmups + args.repeats
    p = {"decode": [prompt() for _ in range(n)]}
    for c in args.concurrency:
        p[f"conc_{c}"] = [[prompt() for _ in range(c)] for _ in range(n)]
    return p


class EngineRate:
    """Samples the head node's generated-token counter while a batch runs. Its slope over the
    middle half of the batch's tokens (every stream decoding) is the pipeline's own decode
    rate: the engine never waits for its clients, so this is what the stages sustain whatever
    the gateway and this one-process client can carry."""

    METRIC = "omlx_node_tokens_predicted_total"

    def __init__(self, url: str, every: float = 0.02):
        self.url, self.every = url, every
        self.samples: list[tuple[float, float]] = []
        self.micro_batches: float | None = None  # the most the head chose (default mode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self, client) -> float | None:
        value = None
        for line in client.get(self.url, timeout=2.0).text.splitlines():
            # Each series carries the stage's labels: `name{node="...",...} value`.
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == self.METRIC:
                value = float(line.rsplit(" ", 1)[1])
            elif name == "omlx_node_micro_batches":
                self.micro_batches = max(self.micro_batches or 0.0,
                                         float(line.rsplit(" ", 1)[1]))
        return value

    def _run(self) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                v = self._read(client)
                if v is not None:
                    self.samples.append((t, v))
                self._stop.wait(self.every)

    def __enter__(self) -> "EngineRate":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def rate(self) -> float | None:
        """Tokens/s between the samples where 25% and 75% of the batch's tokens were out."""
        if len(self.samples) < 3:
            return None
        v0, v1 = self.samples[0][1], self.samples[-1][1]
        lo = next((s for s in self.samples if s[1] - v0 >= 0.25 * (v1 - v0)), None)
        hi = next((s for s in self.samples if s[1] - v0 >= 0.75 * (v1 - v0)), None)
        if lo is None or hi is None or hi[0] <= lo[0]:
            return None
        return (hi[1] - lo[1]) / (hi[0] - lo[0])


class GpuBusy:
    """Samples nvidia-smi's `utilization.gpu` of every GPU while a batch runs: the share of
    time a kernel ran, per device. With one GPU per stage, a stage's busy fraction."""

    def __init__(self, every_ms: int = 100):
        self.samples: list[tuple[float, int, float]] = []  # (time, gpu index, percent)
        self._proc = None
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu",
                 "--format=csv,noheader,nounits", f"-lms={every_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                index, percent = (x.strip() for x in line.split(","))
                self.samples.append((time.perf_counter(), int(index), float(percent)))
            except ValueError:
                continue  # a header or an "[N/A]" reading

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)
            self._thread.join(5)

    def busy(self, devices: list[str], t0: float, t1: float) -> list[float] | None:
        """Mean busy fraction of each device in `devices` (GPU indices, a stage's each) over
        the middle half of [t0, t1]; None without samples."""
        lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
        out = []
        for d in devices:
            xs = [pct for t, i, pct in self.samples if str(i) == d and lo <= t <= hi]
            if not xs:
                return None
            out.append(round(statistics.mean(xs) / 100, 3))
        return out


def stage_devices(nodes: int) -> list[str]:
    """The GPU of each stage, as `serve` pins them (OMLX_NODE_DEVICES, round robin)."""
    devices = [d for d in os.environ.get("OMLX_NODE_DEVICES", "").split(",") if d]
    return [devices[i % len(devices)] for i in range(nodes)] if devices else []


def measure_config(cfg: dict, model: Path, prompts: dict, args, work: Path) -> dict:
    """Starts `serve` with cfg's flags, warms it up, times batch-1 decode and every concurrency
    level; returns what it measured (and an error with the server log's tail if it failed)."""
    import httpx

    t_cfg = time.monotonic()
    extra = ["--nodes", str(cfg["nodes"])]
    if cfg["k"] is not None:
        extra += ["--micro-batches", str(cfg["k"])]
    metrics_port = free_port()
    extra += ["--node-metrics-port", str(metrics_port), *args.server_arg]
    log_path = work / f"server_{cfg['key']}.log"
    res: dict = {"nodes": cfg["nodes"], "k": cfg["k"] or cfg["nodes"],
                 "k_flag": cfg["k"], "server_args": extra}
    server = Server(model, log_path, extra)

    def note(msg: str) -> None:
        print(f"  [{cfg['key']}] {msg}", file=sys.stderr, flush=True)

    try:
        ready = server.wait_ready(SERVER_START_TIMEOUT)
        res["ready_s"] = ready
        health = httpx.get(server.base + "/health", timeout=5.0).json()
        res["stages"] = [{"layers": n.get("layers"), "dtype": n.get("dtype")}
                         for n in health.get("nodes", [])]
        note(f"ready in {ready:.1f}s; layers {[s['layers'] for s in res['stages']]}")
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(timeout=httpx.Timeout(args.timeout),
                                   limits=httpx.Limits(max_connections=256))
        deadline = time.monotonic() + args.timeout

        def run(coro):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{cfg['key']} ran past its time limit ({args.timeout}s)")
            try:
                return loop.run_until_complete(asyncio.wait_for(coro, left))
            except (asyncio.TimeoutError, TimeoutError):
                raise TimeoutError(f"{cfg['key']} ran past its time limit ({args.timeout:.0f}s "
                                   "for all its requests, --timeout)") from None

        def single(prompt, max_tokens):
            r = run(stream_one(client, server.base, prompt, max_tokens))
            return {k: r[k] for k in ("ttft", "decode_tps", "tokens")}

        devices = stage_devices(cfg["nodes"])

        def batch(prompt_set, max_tokens):
            gpus = GpuBusy() if devices else None
            try:
                t0 = time.perf_counter()
                with EngineRate(f"http://127.0.0.1:{metrics_port}/metrics") as engine:
                    r = run(stream_batch(client, server.base, prompt_set, max_tokens))
                t1 = time.perf_counter()
            finally:
                if gpus is not None:
                    gpus.stop()
            return {**r, "engine_tps": engine.rate(), "micro_batches": engine.micro_batches,
                    "stage_busy": gpus.busy(devices, t0, t1) if gpus else None}

        try:
            w = args.warmups
            t = time.monotonic()
            for i in range(w):
                if not args.skip_batch1:
                    single(prompts["decode"][i], args.warmup_tokens or args.decode_tokens)
                for c in args.concurrency:
                    batch(prompts[f"conc_{c}"][i], args.warmup_tokens or args.conc_tokens)
            res["warmup_s"] = time.monotonic() - t
            note(f"warmed up in {res['warmup_s']:.1f}s")
            if not args.skip_batch1:
                runs = [single(prompts["decode"][w + i], args.decode_tokens)
                        for i in range(args.repeats)]
                res["decode_b1"] = {"runs": runs,
                                    "median_tps": median([r["decode_tps"] for r in runs]),
                                    "median_ttft": median([r["ttft"] for r in runs])}
                note(f"decode b1: {res['decode_b1']['median_tps']:.2f} tok/s")
            for c in args.concurrency:
                runs = [batch(prompts[f"conc_{c}"][w + i], args.conc_tokens)
                        for i in range(args.repeats)]
                res[f"agg_{c}"] = {"runs": runs,
                                   "median_tps": median([r["agg_tps"] for r in runs]),
                                   "median_steady_tps": median([r["steady_tps"] for r in runs]),
                                   "median_engine_tps": median([r["engine_tps"] for r in runs]),
                                   "median_stage_busy": median_busy(runs),
                                   "median_ttft_mean": median([r["ttft_mean"] for r in runs])}
                note(f"aggregate x{c}: {res[f'agg_{c}']['median_tps']:.1f} tok/s "
                     f"(decode phase {res[f'agg_{c}']['median_steady_tps'] or 0:.1f}, engine "
                     f"{res[f'agg_{c}']['median_engine_tps'] or 0:.1f})")
        finally:
            loop.run_until_complete(client.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-2000:]
        note(f"FAILED: {res['error'][:500]}")
    finally:
        server.stop()
        res["log_tail"] = server.tail(40) if "error" in res else ""
        res["seconds"] = time.monotonic() - t_cfg
    return res


# ---- summary ------------------------------------------------------------------------------------


def median_busy(runs: list[dict]) -> list[float] | None:
    """Each stage's median busy fraction over the runs that have one."""
    rows = [r["stage_busy"] for r in runs if r.get("stage_busy")]
    return [median(list(col)) for col in zip(*rows)] if rows else None


def ratio(a, b):
    return a / b if a and b else None


def get(configs: dict, key: str, metric: str, field: str = "median_tps"):
    c = configs.get(key) or {}
    return (c.get(metric) or {}).get(field)


def summarize(result: dict, args) -> list[dict]:
    cf, rows = result["configs"], []
    one = "s1"
    for n in sorted({c["nodes"] for c in cf.values() if c["nodes"] > 1 and not c.get("skipped")}):
        kk, k1, auto = f"s{n}_k{n}", f"s{n}_k1", f"s{n}_auto"
        rows.append({"metric": f"batch-1 decode tok/s: {n} stages (default) / 1 stage",
                     "a": get(cf, auto, "decode_b1"), "b": get(cf, one, "decode_b1"),
                     "unit": "tok/s", "goal": None})
        for c in args.concurrency:
            rows.append({"metric": f"aggregate tok/s, {c} streams: {n} stages K={n} / K=1",
                         "a": get(cf, kk, f"agg_{c}"), "b": get(cf, k1, f"agg_{c}"),
                         "unit": "tok/s", "goal": 1.5 if n == 2 else None})
        for c in args.concurrency:
            rows.append({"metric": f"engine decode tok/s, {c} streams: {n} stages K={n} / K=1",
                         "a": get(cf, kk, f"agg_{c}", "median_engine_tps"),
                         "b": get(cf, k1, f"agg_{c}", "median_engine_tps"),
                         "unit": "tok/s", "goal": None})
        for c in args.concurrency:
            rows.append({"metric": f"engine decode tok/s, {c} streams: {n} stages default / K=1",
                         "a": get(cf, auto, f"agg_{c}", "median_engine_tps"),
                         "b": get(cf, k1, f"agg_{c}", "median_engine_tps"),
                         "unit": "tok/s", "goal": None})
        for c in args.concurrency:
            rows.append({"metric": f"engine decode tok/s, {c} streams: {n} stages default / "
                                   "1 stage",
                         "a": get(cf, auto, f"agg_{c}", "median_engine_tps"),
                         "b": get(cf, one, f"agg_{c}", "median_engine_tps"),
                         "unit": "tok/s", "goal": None})
    for r in rows:
        r["ratio"] = ratio(r["a"], r["b"])
    return rows


def fmt(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def markdown(result: dict, args) -> str:
    m, s = result["machine"], result["settings"]
    gpus = [g for g in (m["gpu"] or "").splitlines() if g.strip()]
    dev = (f"{len(gpus)} x {gpus[0]}" if gpus else m["cpu"])
    hop = result["hop"]
    dtype = hop.get("dtype") or next((st["dtype"] for c in result["configs"].values()
                                      for st in c.get("stages", []) if st.get("dtype")), "n/a")
    lines = [
        f"# Pipeline benchmark: N stages vs 1 stage, K micro-batches vs lockstep ({result['tag']})",
        "",
        f"- machine: {dev} ({m['cpu_count']} CPU cores: {m['cpu']}); stages pinned to devices "
        f"`OMLX_NODE_DEVICES={result['env']['OMLX_NODE_DEVICES'] or '(unset)'}`",
        f"- mlx {result['versions'].get('mlx')}, mlx-lm {result['versions'].get('mlx_lm')}, "
        f"python {m['python']}, commit {m['git_commit']}",
        f"- model: {result['model']['name']} ({result['model']['desc']}); compute dtype "
        f"{dtype}",
        f"- BLAS of the nodes: {result['blas']}",
        f"- settings: prompt {s['prompt_tokens']} tok, batch-1 max_tokens {s['decode_tokens']}, "
        f"concurrent max_tokens {s['conc_tokens']} at {', '.join(map(str, s['concurrency']))} "
        f"streams, medians of {s['repeats']} runs after {s['warmups']} warm-up round(s) "
        f"(warm-up max_tokens {s['warmup_tokens'] or 'full length'}), "
        f"server flags `{' '.join(s['server_args']) or '(defaults)'}`",
        "",
        "## Ratios",
        "",
        "| comparison | a | b | ratio a/b | goal |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        goal = f">= {r['goal']}" if r["goal"] else ""
        lines.append(f"| {r['metric']} | {fmt(r['a'])} | {fmt(r['b'])} | {fmt(r['ratio'])} | "
                     f"{goal} |")
    lines += ["", "## Every configuration (medians)", ""]
    head = ["config", "layers per stage", "batch-1 decode tok/s"]
    for c in s["concurrency"]:
        head += [f"agg tok/s x{c}", f"decode-phase tok/s x{c}", f"engine tok/s x{c}",
                 f"mean TTFT x{c} (ms)", f"stage busy % x{c}"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, c in result["configs"].items():
        if c.get("skipped"):
            lines.append(f"| {c['label']} | skipped: {c['skipped']} |" + " |" * (len(head) - 2))
            continue
        layers = ", ".join(f"[{a},{b})" for a, b in (st["layers"] for st in c.get("stages", [])))
        cells = [c["label"], layers or "n/a", fmt(get(result["configs"], key, "decode_b1"))]
        for n in s["concurrency"]:
            a = c.get(f"agg_{n}") or {}
            ttft = a.get("median_ttft_mean")
            busy = a.get("median_stage_busy")
            cells += [fmt(a.get("median_tps")), fmt(a.get("median_steady_tps")),
                      fmt(a.get("median_engine_tps")), fmt(ttft * 1000 if ttft else None),
                      " / ".join(f"{b * 100:.0f}" for b in busy) if busy else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
        if c.get("error"):
            lines.append(f"| ^ failed: {c['error'][:300]} |" + " |" * (len(head) - 1))
    lines += ["", "## Data plane: one decode step over the mx.distributed ring on loopback", ""]
    if hop.get("error", "").startswith("skipped"):
        lines += ["Not run in this invocation (--skip-hop).", ""]
    elif hop.get("error"):
        lines += ["The hop test failed:", "", "```", hop["error"][-1500:], "```", ""]
    else:
        lines += [f"Two processes, ring backend, devices {hop.get('device')} "
                  f"(pinned: {hop.get('devices') or 'no'}), hidden size {hop['hidden_size']}, "
                  f"{hop['cases'][0]['iters'] if hop['cases'] else 0} timed iterations per case. "
                  "A decode step is what `PipelineHead._launch` sends (`wire.send_step`): header "
                  "int32[64] with the payload int32[2] inline, then the hidden (rows, 1, hidden); "
                  "int32[rows] tokens come back. "
                  "One way ~= rtt / 2.", "",
                  "| case | hidden bytes | rtt median (us) | p10 | p90 | one way (us) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for c in hop["cases"]:
            lines.append(f"| {c['name']} | {c['hidden_bytes']} | {c['rtt_median_us']:.0f} | "
                         f"{c['rtt_p10_us']:.0f} | {c['rtt_p90_us']:.0f} | "
                         f"{c['one_way_us']:.0f} |")
    lines += ["", "Ratios > 1 mean a is faster. Throughput is measured end to end through HTTP "
              "streaming (gateway -> gRPC -> head worker -> ring -> ...); aggregate = completion "
              "tokens / wall time from the first request sent to the last stream finished "
              "(prefill included); decode phase = tokens/s while every stream is decoding, as this "
              "one-process client sees them; engine = the head node's generated-token counter "
              "(Prometheus) over the middle half of each batch's tokens, what the stages "
              "sustain whatever the gateway and the client carry; stage busy = nvidia-smi's "
              "utilization.gpu of each stage's GPU (share of time a kernel ran), rank 0 first, "
              "over the middle half of each batch (n/a: no GPU per stage).", ""]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", help="results file tag (default: cpu/h200/h200xN/gpu)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2],
                    help="pipeline lengths to compare with one stage, e.g. 2 4 (each >= 2)")
    ap.add_argument("--configs", help="only these configurations, comma-separated keys "
                                      "(s1, s2_auto, s2_k2, s2_k1, s3_k3, s3_k1); default: all")
    ap.add_argument("--skip-batch1", action="store_true",
                    help="measure the concurrency levels only")
    ap.add_argument("--skip-hop", action="store_true", help="skip the data-plane hop test")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmups", type=int, default=1,
                    help="warm-up rounds: each is one batch-1 request and one batch per level")
    ap.add_argument("--decode-tokens", type=int, default=32, help="max_tokens, batch-1 decode")
    ap.add_argument("--conc-tokens", type=int, default=16, help="max_tokens per concurrent stream")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--warmup-tokens", type=int, default=0,
                    help="max_tokens of warm-up requests (0: the full length, needed on a GPU)")
    ap.add_argument("--hop-iters", type=int, default=300)
    ap.add_argument("--hop-warmup", type=int, default=30)
    ap.add_argument("--hop-rows", type=int, nargs="*", default=[16, 32])
    ap.add_argument("--hop-timeout", type=float, default=120.0)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for every `serve` (repeatable)")
    ap.add_argument("--timeout", type=float, default=420.0,
                    help="time limit of one configuration's requests, seconds")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="time budget in seconds for the pipeline lengths after the first "
                         "of --stages: each length's three runs start only if three times the "
                         "slowest configuration so far still fits (0: no budget); 1 stage and "
                         "the first length always run")
    ap.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp folder)")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child == "hop":
        res = hop_rank(json.loads(Path(args._spec).read_text()))
        Path(args._result).write_text(json.dumps(res))
        return 0
    if min(args.stages) < 2:
        ap.error("every --stages value must be at least 2")

    from omlx_shared.blas import blas_env

    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-pipe-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    gpus = [g for g in (machine["gpu"] or "").splitlines() if g.strip()]
    if args.tag:
        tag = args.tag
    elif gpus and "H200" in gpus[0]:
        tag = "h200" if len(gpus) == 1 else f"h200x{len(gpus)}"
    else:
        tag = "gpu" if gpus else "cpu"
    node_env = blas_env()
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",
                                                                 "OPENBLAS_NUM_THREADS")}

    model, model_name, desc, config = select_model(args, work, base_env)
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    model_dtype = str(config.get("torch_dtype") or "float32")
    if model_dtype not in ("float32", "float16", "bfloat16"):
        model_dtype = "float32"

    versions = {}
    try:
        versions["mlx"] = subprocess.run(
            [sys.executable, "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, "
             "mlx_lm.__version__)"], capture_output=True, text=True, timeout=60,
            env=node_env).stdout.split()
        versions = {"mlx": versions["mlx"][0], "mlx_lm": versions["mlx"][1]}
    except (subprocess.SubprocessError, IndexError, OSError):
        versions = {}

    settings = {k: getattr(args, k) for k in ("repeats", "warmups", "decode_tokens",
                                              "conc_tokens", "concurrency", "prompt_tokens",
                                              "warmup_tokens", "hop_iters", "hop_warmup",
                                              "hop_rows", "timeout", "budget")}
    settings["server_args"] = args.server_arg
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "versions": versions,
              "model": {"name": model_name, "desc": desc, "path": str(model),
                        "layers": config["num_hidden_layers"], "hidden_size": hidden},
              "settings": settings, "blas": blas_of(node_env),
              "env": {"OMLX_NODE_DEVICES": os.environ.get("OMLX_NODE_DEVICES")},
              "hop": {}, "configs": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"pipeline-{tag}.partial.json"

    def save_partial() -> None:
        partial.write_text(json.dumps(result, indent=1))

    print(f"model {model} | tag {tag} | BLAS {result['blas']} | work {work}", file=sys.stderr,
          flush=True)
    print("== data-plane hop test ==", file=sys.stderr, flush=True)
    try:
        result["hop"] = ({"error": "skipped (--skip-hop)", "cases": []} if args.skip_hop else
                         hop_bench(hidden, model_dtype, args, node_env, work))
    except Exception as e:  # keep going: the servers are measured regardless
        result["hop"] = {"error": f"{type(e).__name__}: {e}", "cases": []}
    if result["hop"].get("error") and not args.skip_hop:
        print(f"  hop test FAILED: {result['hop']['error'][-1500:]}", file=sys.stderr, flush=True)
    for c in result["hop"].get("cases", []):
        print(f"  {c['name']}: rtt {c['rtt_median_us']:.0f} us (p10 {c['rtt_p10_us']:.0f}, "
              f"p90 {c['rtt_p90_us']:.0f}), one way ~{c['one_way_us']:.0f} us",
              file=sys.stderr, flush=True)
    save_partial()

    prompts = make_prompts(vocab, args)
    configs = [{"key": "s1", "label": "1 stage", "nodes": 1, "k": None}]
    for i, n in enumerate(dict.fromkeys(args.stages)):
        group = [{"key": f"s{n}_auto", "label": f"{n} stages, default (up to K={n}, as many as "
                  "pay off)", "nodes": n, "k": None},
                 {"key": f"s{n}_k{n}", "label": f"{n} stages, K={n} always", "nodes": n, "k": n},
                 {"key": f"s{n}_k1", "label": f"{n} stages, K=1 (lockstep)", "nodes": n, "k": 1}]
        if i > 0:  # a length after the first runs whole or not at all, within --budget
            group[0]["optional"] = len(group)
            for cfg in group[1:]:
                cfg["after"] = group[0]["key"]
        configs += group
    if args.configs:
        wanted = set(args.configs.split(","))
        configs = [c for c in configs if c["key"] in wanted]
    slowest = 0.0
    for cfg in configs:
        spent = time.monotonic() - t_start
        skip = None
        if cfg.get("optional") and args.budget and spent + cfg["optional"] * slowest > args.budget:
            skip = f"time budget ({spent:.0f}s of {args.budget:.0f}s spent)"
        if cfg.get("after") and result["configs"].get(cfg["after"], {}).get("skipped"):
            skip = result["configs"][cfg["after"]]["skipped"]
        if skip:
            result["configs"][cfg["key"]] = {"label": cfg["label"], "nodes": cfg["nodes"],
                                             "k": cfg["k"] or cfg["nodes"], "skipped": skip}
            print(f"== {cfg['label']}: skipped (budget) ==", file=sys.stderr, flush=True)
            continue
        print(f"== {cfg['label']} ==", file=sys.stderr, flush=True)
        res = measure_config(cfg, model, prompts, args, work)
        slowest = max(slowest, res["seconds"])
        result["configs"][cfg["key"]] = {"label": cfg["label"], **res}
        save_partial()

    result["rows"] = summarize(result, args)
    result["bench_seconds"] = round(time.monotonic() - t_start, 1)
    (args.out / f"pipeline-{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"pipeline-{tag}.md").write_text(markdown(result, args))
    partial.unlink(missing_ok=True)
    print(markdown(result, args))
    print(f"wrote {args.out}/pipeline-{tag}.json and .md ({result['bench_seconds']:.0f}s)",
          file=sys.stderr)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    failed = [k for k, c in result["configs"].items() if c.get("error")]
    return 1 if failed or (result["hop"].get("error") and not args.skip_hop) else 0


if __name__ == "__main__":
    sys.exit(main())
