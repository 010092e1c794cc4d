#!/usr/bin/env python3
"""Single-node benchmark: our server against mlx_lm.server and raw mlx-lm, on the same model
and prompts, in one run, with ratios.

Three sides, each run alone (one stopped before the next starts); with --rounds R the three
run R times, in reverse order every other round (ours, mlx_lm.server, raw; then raw,
mlx_lm.server, ours), each ratio is taken within a round and the table shows their median and
each round's. A host whose speed drifts during a run (seen on the H200 leases: raw's own
batch-1 rate changed by 1.5x between two runs back to back) then moves every side alike:

- ours: `python -m omlx_cluster serve` (HTTP gateway -> gRPC -> node batcher), streamed over HTTP;
- mlx_lm.server: `python -m mlx_lm.server --decode-concurrency N` (N: the highest concurrency),
  streamed over HTTP the same way, its prompts given as text (it takes no token ids);
- raw: mlx-lm `BatchGenerator` / `generate_step` in-process (no HTTP, no detokenising).

Workloads, each a median of --repeats timed runs after a warm-up:

1. batch-1 tok/s, end to end (request sent to stream finished, a short prompt);
2. aggregate tok/s at 8, 32 and 64 concurrent streams: completion tokens / wall time from the
   first request sent to the last stream finished (prefill included); raw gets the same prompts
   all inserted at once;
3. TTFT at batch 1 at 2048 and 8192 prompt tokens (raw: the prefill plus first sample);
4. ours only: the idle CPU of every process of the server (/proc/<pid>/stat ticks over a window
   with no request in flight), and a check that the load client is not the bottleneck: the
   highest concurrency again with twice the client processes.

The HTTP load comes from --client-procs separate processes (streams split between them), each
started and connected before a go signal, so Python's client cost is spread out of the timed path.

Fairness: every MLX process gets the node's environment (`omlx_shared.blas.blas_env`: the same
LD_PRELOAD/OPENBLAS_NUM_THREADS) and the node's compute dtype (raw: float32 and dequantized on a
CPU, like the node; mlx_lm.server computes in the dtype on disk, so the CPU default model is a
float32 random llama).

    python -m bench.single_node                        # CPU: small float32 random llama
    python -m bench.single_node --random-llama 1b      # GPU: TinyLlama-shaped 1.1B, bf16
    python -m bench.single_node --random-llama 8b      # GPU: Llama-3-8B layers, bf16
    python -m bench.single_node --model default        # the default model (SmolLM2-135M)

Results: bench/results/single-node-<tag>.json and .md (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    SERVER_START_TIMEOUT,
    MlxLmServer,
    Server,
    add_workload_args,
    blas_of,
    fmt,
    idle_cpu,
    machine_info,
    machine_tag,
    make_prompts,
    median,
    ours_body,
    plain_env,
    ratio,
    raw_mlx_lm,
    run_child,
    run_workloads,
    select_model,
)
from bench.load_client import http_workloads

# This module as its own child (the BLAS probe, the raw side), run with `-m`.
SELF = "bench.single_node"


def blas_probe() -> dict:
    """fp32 GEMM (prefill-like) and GEMV (decode-like) GFLOP/s in this process's environment."""
    import mlx.core as mx

    out = {}
    for name, (m, k, n) in {"gemm_1024": (1024, 1024, 1024), "gemv_576x49152": (1, 576, 49152),
                            "gemm_32x576x1536": (32, 576, 1536)}.items():
        a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
        mx.eval(a, b)
        mx.eval(a @ b)
        reps, t = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t < 0.5:
            mx.eval(a @ b)
            reps += 1
        out[name] = round(2 * m * k * n * reps / (time.perf_counter() - t) / 1e9, 2)
    return out


def reference(spec: dict) -> dict:
    """Raw mlx-lm on the same model, prompts and max_tokens; runs in the node's environment."""
    single, batch, info = raw_mlx_lm(Path(spec["model"]), time.monotonic() + spec["timeout"])
    return run_workloads(spec, single, batch) | info


# ---- the HTTP load client (child processes) -----------------------------------------------------


# ---- the servers --------------------------------------------------------------------------------


LATENCY_PARTS = {"gateway": "omlx_time_to_first_token_seconds",
                 "engine": "omlx_node_time_to_first_token_seconds",
                 "engine queue": "omlx_node_request_queue_seconds",
                 "engine prefill": "omlx_node_request_prefill_seconds"}


def latency_sums(server: Server) -> dict[str, tuple[float, float]]:
    """(sum, count) of each LATENCY_PARTS histogram, from the gateway's and the worker's
    /metrics (the worker's address comes from /cluster/status)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    status = httpx.get(server.base + "/cluster/status", timeout=10).json()
    urls = [server.base + "/metrics"] + [f"http://{w['metrics']}/metrics" for n in status["nodes"]
                                         for w in n["workers"] if w.get("metrics")]
    found: dict[str, list[float]] = {}
    for url in urls:
        for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for sample in fam.samples:
                for suffix in ("_sum", "_count"):
                    if sample.name.endswith(suffix):
                        key = sample.name.removesuffix(suffix)
                        found.setdefault(key, [0.0, 0.0])[suffix == "_count"] += sample.value
    return {part: tuple(found.get(name, (0.0, 0.0))) for part, name in LATENCY_PARTS.items()}


def ttft_breakdown(server: Server, single, lengths: list[int], max_tokens: int, vocab: int
                   ) -> dict[str, dict[str, float]]:
    """Where a long prompt's first token goes: the client's TTFT against the gateway's (request
    in to first token out) and the engine's (submission to first token read, with its queue and
    prefill parts), ms, over three fresh prompts of each length (no prefix-cache hit): the
    client's median, the server's means. It runs right after the concurrent runs, and there the
    first long prefill is slower for raw mlx-lm too (1.5x on an H200), so one would mislead."""
    rng = random.Random(4321)
    out = {}
    for n in lengths:
        before = latency_sums(server)
        client = median([single([rng.randrange(100, vocab - 1) for _ in range(n)],
                                max_tokens)["ttft"] for _ in range(3)])
        after = latency_sums(server)
        row = {"client": client * 1000}
        for part, (s0, c0) in before.items():
            s1, c1 = after[part]
            row[part] = (s1 - s0) / (c1 - c0) * 1000 if c1 > c0 else None
        out[str(n)] = row
    return out


def measure_ours(spec: dict, model: Path, work: Path, extra: list[str], procs: int,
                 idle_seconds: float, extras: bool = True) -> dict:
    """`extras`: also the TTFT breakdown, the load-client check and the idle CPU (once a run)."""
    server = Server(model, work / "server.log", extra)
    try:
        ready_s = server.wait_ready(SERVER_START_TIMEOUT)
        print(f"  [ours] server ready in {ready_s:.1f}s", file=sys.stderr, flush=True)
        single, batch = http_workloads(spec, server.base + "/v1/completions", ours_body, work,
                                       procs)
        out = run_workloads(spec, single, batch)
        if not extras:
            return out | {"server_ready_s": ready_s}
        top = max(spec["concurrency"])
        prompts = spec["prompts"][f"conc_{top}"][1]
        out["ttft_breakdown"] = ttft_breakdown(server, single, spec["ttft_prompts"],
                                               spec["ttft_tokens"], spec["vocab"])
        out["client_check"] = {
            "streams": top, "procs": [procs, 2 * procs],
            "agg_tps": [batch(prompts, spec["conc_tokens"], n)["agg_tps"]
                        for n in (procs, 2 * procs)]}
        time.sleep(1.0)  # the last stream's teardown
        out["idle_cpu"] = idle_cpu(server, idle_seconds)
        out["idle_seconds"] = idle_seconds
        out["server_ready_s"] = ready_s
        return out
    except Exception:
        print(f"server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


def measure_mlx_server(spec: dict, model: Path, work: Path, env: dict, procs: int) -> dict:
    """mlx_lm.server on the same prompts, decoded to text (it takes no token ids)."""
    import mlx_lm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))

    server = MlxLmServer(model, work / "mlx_lm_server.log",
                         ["--decode-concurrency", str(max(spec["concurrency"]))], env)

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": "default_model", "prompt": tok.decode(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}

    try:
        ready_s = server.wait_ready(SERVER_START_TIMEOUT)
        print(f"  [mlx_lm.server] ready in {ready_s:.1f}s", file=sys.stderr, flush=True)
        single, batch = http_workloads(spec, server.base + "/v1/completions", body, work, procs)
        return run_workloads(spec, single, batch) | {"mlx_lm_version": mlx_lm.__version__,
                                                     "server_ready_s": ready_s}
    except Exception:
        print(f"mlx_lm.server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


# ---- orchestration ------------------------------------------------------------------------------


SIDES = ("ours", "mlx_server", "raw")


def summarize(sides: dict[str, dict], conc: list[int], ttft_prompts: list[int]) -> list[dict]:
    """One row per workload: each side's value and the speed ratios ours/raw, ours/mlx_server
    (> 1: ours is faster; for a time, the other's time / ours)."""
    def row(metric: str, key: str, field: str, unit: str, goal: float | None, scale=1.0):
        vals = {s: (sides[s][key][field] * scale if sides[s][key][field] is not None else None)
                for s in SIDES}
        faster = ratio if unit == "tok/s" else (lambda a, b: ratio(b, a))
        return {"metric": metric, "unit": unit, "goal": goal, **vals,
                "vs_raw": faster(vals["ours"], vals["raw"]),
                "vs_mlx_server": faster(vals["ours"], vals["mlx_server"])}

    rows = [row("tok/s, batch 1 (end to end)", "decode_b1", "median_tps", "tok/s", None)]
    rows += [row(f"aggregate tok/s, {c} streams", f"agg_{c}", "median_tps", "tok/s", 0.9)
             for c in conc]
    rows += [row(f"mean TTFT, {c} streams at once", f"agg_{c}", "median_ttft_mean", "ms", None,
                 1000) for c in conc]
    rows += [row(f"TTFT, batch 1, {n}-token prompt", f"ttft_{n}", "median_s", "ms", None, 1000)
             for n in ttft_prompts]
    return rows


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Each metric over the rounds: every side's median value, and the median of the ratios
    taken within each round (with each round's, `vs_raw_rounds`)."""
    out = []
    for rows in zip(*rounds):
        row = dict(rows[0])
        for k in (*SIDES, "vs_raw", "vs_mlx_server"):
            row[k] = median([r[k] for r in rows if r[k] is not None])
        row["vs_raw_rounds"] = [r["vs_raw"] for r in rows]
        out.append(row)
    return out


def markdown(result: dict) -> str:
    m, s, raw, ours = result["machine"], result["settings"], result["raw"], result["ours"]
    by_round = s.get("rounds", 1) > 1
    dev = m["gpu"] or m["cpu"]
    lines = [
        f"# Single-node benchmark: omlx-cluster vs mlx_lm.server vs raw mlx-lm ({result['tag']})",
        "",
        (f"- machine: {result['machine_note'] or dev} ({m['cpu_count']} CPU cores: {m['cpu']}); "
         f"MLX device `{raw['device']}`"),
        (f"- mlx {raw['mlx_version']}, mlx-lm {raw['mlx_lm_version']}, python {m['python']}, "
         f"commit {m['git_commit']}"),
        (f"- model: {result['model']['name']} ({result['model']['desc']}), compute dtype "
         f"{raw['dtype']} (raw; the node computes the same)"),
        f"- BLAS (every MLX process): {result['blas']['used']}",
        (f"- settings: prompt {s['prompt_tokens']} tok, decode max_tokens {s['decode_tokens']}, "
         f"concurrent max_tokens {s['conc_tokens']}, TTFT max_tokens {s['ttft_tokens']}, "
         f"medians of {s['repeats']} runs after {s.get('warmup_runs', 1)} warm-up run(s), "
         f"{s['client_procs']} load-client processes; our server's flags `{' '.join(s['server_args']) or '(defaults)'}`, "
         f"mlx_lm.server `--decode-concurrency {max(s['concurrency'])}`"
         + (f"; {s['rounds']} rounds, values and ratios their medians" if by_round else "")),
        "",
        ("| metric | omlx-cluster | mlx_lm.server | raw mlx-lm | ours/raw | ours/mlx_lm.server "
         "| goal (ours/raw) |" + (" ours/raw by round |" if by_round else "")),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if by_round else ""),
    ]
    for r in result["rows"]:
        goal = f">= {r['goal']}" if r["goal"] else ""
        lines.append(f"| {r['metric']} | {fmt(r['ours'])} {r['unit']} | "
                     f"{fmt(r['mlx_server'])} {r['unit']} | {fmt(r['raw'])} {r['unit']} | "
                     f"{fmt(r['vs_raw'])} | {fmt(r['vs_mlx_server'])} | {goal} |"
                     + (f" {' / '.join(fmt(x) for x in r['vs_raw_rounds'])} |" if by_round else ""))
    lines += ["", ("Ratios > 1: omlx-cluster is faster (for a time: the other's time / ours). "
                   "Ours and mlx_lm.server are measured end to end through HTTP streaming; raw "
                   "mlx-lm in-process (`generate_step`, `BatchGenerator`, no HTTP, no "
                   "detokenising)."), ""]
    lines += [client_check_line(ours), "", breakdown_line(ours), "", idle_line(ours), ""]
    if result["blas"].get("probe"):
        lines.append("BLAS probe (fp32 GFLOP/s): " + "; ".join(
            f"{k}: {v}" for k, v in result["blas"]["probe"].items()))
        lines.append("")
    return "\n".join(lines)


def client_check_line(ours: dict) -> str:
    c = ours["client_check"]
    (p1, p2), (a1, a2) = c["procs"], c["agg_tps"]
    change = ratio(a2, a1)
    verdict = "the client is not the bottleneck" if change and abs(change - 1) < 0.1 else \
        "CHANGED: the client may be the bottleneck"
    return (f"Load-client check (ours, {c['streams']} streams): {p1} client processes "
            f"{fmt(a1)} tok/s, {p2} processes {fmt(a2)} tok/s ({fmt(change)}x): {verdict}.")


def breakdown_line(ours: dict) -> str:
    parts = "; ".join(f"{n} tokens: " + ", ".join(f"{k} {fmt(v)}" for k, v in row.items())
                      for n, row in ours["ttft_breakdown"].items())
    return (f"Where our TTFT goes (ms, three fresh prompts each, right after the concurrent "
            f"runs; client = the load client's median, the server's parts their means; "
            f"gateway = request in to first token out, engine = submission to first token "
            f"read on the worker): {parts}.")


def idle_line(ours: dict) -> str:
    procs = ", ".join(f"{r['name']} (pid {r['pid']}) {r['cpu_percent']:.1f}%"
                      for r in ours["idle_cpu"])
    return (f"Idle CPU of our server's processes (% of one core over {ours['idle_seconds']:.0f} s "
            f"with no request in flight, from /proc/<pid>/stat): {procs}.")


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"omlx-cluster vs mlx_lm.server vs raw mlx-lm, single node "
                    f"({result['tag']}: {result['machine']['gpu'] or result['machine']['cpu']})")
    by_round = result["settings"].get("rounds", 1) > 1
    for col in ("metric", "omlx-cluster", "mlx_lm.server", "raw mlx-lm", "ours/raw",
                "ours/mlx_lm.server", "goal", *(["ours/raw by round"] if by_round else [])):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in result["rows"]:
        ok = r["goal"] is None or (r["vs_raw"] or 0) >= r["goal"]
        color = "green" if ok else "red"
        t.add_row(r["metric"], f"{fmt(r['ours'])} {r['unit']}",
                  f"{fmt(r['mlx_server'])} {r['unit']}", f"{fmt(r['raw'])} {r['unit']}",
                  f"[{color}]{fmt(r['vs_raw'])}[/{color}]", fmt(r["vs_mlx_server"]),
                  f">= {r['goal']}" if r["goal"] else "",
                  *([" / ".join(fmt(x) for x in r["vs_raw_rounds"])] if by_round else []))
    console = Console(width=160)
    console.print(t)
    console.print(client_check_line(result["ours"]))
    console.print(breakdown_line(result["ours"]))
    console.print(idle_line(result["ours"]))
    console.print(f"BLAS: {result['blas']['used']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the three sides this many times, in reverse order every other "
                         "round; ratios are taken within a round, then their median")
    ap.add_argument("--short-prompt", type=int, help="with --long-prompt: the two TTFT prompt "
                                                     "lengths (same as --ttft-prompts S L)")
    ap.add_argument("--long-prompt", type=int)
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="max_tokens of warm-up runs (on a GPU use the full length: new shapes "
                         "JIT-compile)")
    ap.add_argument("--warmup-runs", type=int, default=1,
                    help="warm-up runs of each workload before the timed ones; on a GPU use 2: "
                         "on the H200 the first timed run after one warm-up was up to 30%% "
                         "slower than the second (each side, some rows; likely the first steps "
                         "at batch sizes the warm-up did not reach)")
    ap.add_argument("--idle-seconds", type=float, default=5.0,
                    help="window of the idle-CPU measurement of our server")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="time limit of each side's measurements, seconds")
    ap.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp folder)")
    ap.add_argument("--skip-blas-probe", action="store_true")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        payload = json.loads(Path(args._spec).read_text())
        if args._child.startswith("probe"):
            res = blas_probe()
        else:
            res = reference(payload)
        Path(args._result).write_text(json.dumps(res))
        return 0

    from omlx_shared.blas import blas_env

    if args.short_prompt and args.long_prompt:
        args.ttft_prompts = [args.short_prompt, args.long_prompt]
    if args.model is None and args.random_llama is None:
        args.random_llama = "small"
    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    tag = args.tag or machine_tag(machine)
    node_env = blas_env()  # exactly what a node agent gives its shard worker
    base_env = plain_env()

    model, model_name, desc, config = select_model(args, work, base_env)
    vocab = int(config["vocab_size"])

    spec = {"model": str(model), "prompts": make_prompts(vocab, args), "repeats": args.repeats,
            "decode_tokens": args.decode_tokens, "conc_tokens": args.conc_tokens,
            "concurrency": args.concurrency, "ttft_tokens": args.ttft_tokens,
            "ttft_prompts": args.ttft_prompts, "warmup_tokens": args.warmup_tokens,
            "warmup_runs": args.warmup_runs,
            "timeout": args.timeout, "vocab": vocab}
    blas = {"used": blas_of(node_env), "node_env": {k: node_env.get(k) for k in
                                                    ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}}
    if not machine["gpu"] and not args.skip_blas_probe:
        probe = {"with_node_env": run_child(SELF, "probe_node", {}, node_env, 120, work)}
        if node_env.get("LD_PRELOAD"):
            probe["mlx_wheel_blas"] = run_child(SELF, "probe_plain", {}, base_env, 120, work)
        blas["probe"] = {f"{env}.{k}": v for env, d in probe.items() for k, v in d.items()}

    print(f"model {model} | BLAS: {blas['used']} | work dir {work}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"single-node-{tag}.partial.json"
    measure = {
        "ours": lambda first: measure_ours(spec | {"side": "ours"}, model, work,
                                           args.server_arg, args.client_procs,
                                           args.idle_seconds, extras=first),
        "mlx_server": lambda first: measure_mlx_server(spec | {"side": "mlx_lm.server"}, model,
                                                       work, node_env, args.client_procs),
        "raw": lambda first: run_child(SELF, "reference", spec | {"side": "raw"}, node_env,
                                   args.timeout + 300, work)}
    titles = {"ours": "omlx-cluster server", "mlx_server": "mlx_lm.server (node environment)",
              "raw": "raw mlx-lm (node environment)"}
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        this: dict[str, dict] = {}
        rounds.append(this)
        for side in SIDES if k % 2 == 0 else reversed(SIDES):
            print(f"== {titles[side]}" + (f", round {k + 1}" if args.rounds > 1 else "") + " ==",
                  file=sys.stderr, flush=True)
            this[side] = measure[side](k == 0)
            partial.write_text(json.dumps({"machine": machine, "model": str(model),
                                           "rounds": rounds}, indent=1))
    sides = rounds[0]
    per_round = [summarize(r, args.concurrency, args.ttft_prompts) for r in rounds]
    rows = combine_rounds(per_round) if args.rounds > 1 else per_round[0]
    settings = {k: getattr(args, k) for k in ("repeats", "rounds", "decode_tokens",
                                              "conc_tokens", "concurrency", "prompt_tokens",
                                              "ttft_prompts", "ttft_tokens", "warmup_tokens",
                                              "warmup_runs", "client_procs")}
    settings["server_args"] = args.server_arg
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "machine_note": args.machine_note,
              "model": {"name": model_name, "desc": desc, "path": str(model)},
              "settings": settings, "blas": blas, "rows": rows, **sides,
              "later_rounds": rounds[1:],
              "bench_seconds": round(time.monotonic() - t_start, 1)}
    (args.out / f"single-node-{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"single-node-{tag}.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    print_table(result)
    print(f"wrote {args.out}/single-node-{tag}.json and .md "
          f"({result['bench_seconds']:.0f}s)", file=sys.stderr)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
