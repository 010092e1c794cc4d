#!/usr/bin/env python3
"""Paired benchmark: our server and raw mlx-lm measured in turns, so that both see the same host.

`bench/single_node.py` runs each side whole, one after the other. On the H200 leases the host's
speed drifts between them (raw mlx-lm's own batch-1 rate moved 1.5x from one round to the next),
and a ratio of two sides measured minutes apart then says more about the host than about us.
Here both sides stay up for the whole run: our server (`python -m omlx_cluster serve`) and a
raw mlx-lm process (`generate_step`, `BatchGenerator`, in the node's environment) that waits,
idle, for each run it is sent. Every timed run of ours is paired with raw's on the same
prompts, taken right before or after it (the order alternates from pair to pair, so a drift
favours neither), and a ratio is taken within each pair; the table shows the median of
the pairs' ratios, each side's median, and every pair's ratio.

Pairs, each workload `--pairs` times after `--warmup-runs` warm-ups of each side:

- batch-1 tok/s, end to end (request sent to stream finished, a 32-token prompt);
- TTFT at batch 1 of 2048- and 8192-token prompts (fresh ones: no prefix-cache hit);
- aggregate tok/s at 8, 32 and 64 concurrent streams (completion tokens / wall time, prefill
  included; raw gets the same prompts inserted at once);
- ours sampled (temperature 0.8, top_p 0.95, top_k 50) against ours greedy, both through HTTP,
  at batch 1 and at 8 and 32 streams.

The HTTP load comes from bench.load_client's processes (started and connected before the
clock starts). Goals are issue 14's: aggregate >= 0.9x raw, batch 1 >= 0.95x, TTFT <= 1.1x raw's
(a speed ratio >= 0.91), sampled >= 0.9x greedy.

    python -m bench.paired --random-llama 1b --pairs 5     # GPU: TinyLlama-shaped, bf16
    python -m bench.paired --random-llama 8b --pairs 5     # GPU: Llama-3-8B layers, bf16
    python -m bench.paired                                 # CPU: the small random llama

Results: bench/results/paired-<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import (
    SERVER_START_TIMEOUT,
    Server,
    add_workload_args,
    fmt,
    machine_info,
    machine_tag,
    median,
    ours_body,
    plain_env,
    raw_mlx_lm,
    select_model,
    with_repo_path,
)
from bench.load_client import http_workloads

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
TTFT_GOAL = round(1 / 1.1, 2)  # TTFT <= 1.1x raw's, as a speed ratio


def sampled_body(prompt: list[int], max_tokens: int) -> dict:
    return ours_body(prompt, max_tokens) | SAMPLED


# ---- the raw side: a child process that runs what it is sent --------------------------------


def raw_child(model: str) -> None:
    """Loads the model, says "ready" with what it runs, then answers one JSON line per request
    line ({"op": "single" | "batch", ...}) until its stdin closes. Its protocol has stdout to
    itself: anything else that prints goes to stderr."""
    import mlx.core as mx

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    single, batch, info = raw_mlx_lm(Path(model), float("inf"))
    # Two MLX processes share the device here, and each one's buffer cache may grow to 80% of
    # its memory: on the H200 our worker ran out of device memory beside a raw side that kept
    # the buffers of its 64-stream and 8192-token runs. Raw keeps at most 1/8 of the device's
    # memory cached, and gives back what it cached between runs (outside the clock).
    device = mx.device_info()
    total = int(device.get("total_memory") or device.get("memory_size") or 0)  # CUDA, Metal
    if total:
        mx.set_cache_limit(total // 8)
    out.write(json.dumps({"ready": info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "single":
            res = single(req["prompt"], req["max_tokens"])
        else:
            res = batch(req["prompts"], req["max_tokens"])
        mx.clear_cache()
        out.write(json.dumps(res) + "\n")


class RawSide:
    """The raw mlx-lm child, in the node's environment."""

    def __init__(self, model: Path, env: dict, log: Path):
        env = with_repo_path(env)
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.paired", "--_raw", str(model)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.info = self._answer()["ready"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the raw mlx-lm child exited ({self.proc.poll()}); its log: "
                               f"{self._log.name}")
        return json.loads(line)

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def single(self, prompt: list[int], max_tokens: int) -> dict:
        return self._ask({"op": "single", "prompt": prompt, "max_tokens": max_tokens})

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return self._ask({"op": "batch", "prompts": prompts, "max_tokens": max_tokens})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# ---- pairs --------------------------------------------------------------------------------------


def paired(name: str, a, b, inputs, key: str, warm, pairs: int, speed: bool) -> dict:
    """`pairs` runs of a(x) and b(x) on the same input x (fresh from `inputs()` for each pair),
    in alternating order, after one run of each on every input of `warm`. `key`: the field of
    a run's result compared; `speed`: a rate (ratio a/b) rather than a time (ratio b/a), so
    that a ratio > 1 always means that a is faster."""
    for x in warm:
        a(x), b(x)
    runs = []
    for i in range(pairs):
        x = inputs()
        if i % 2 == 0:
            ra, rb = a(x), b(x)
        else:
            rb, ra = b(x), a(x)
        va, vb = ra[key], rb[key]
        runs.append({"a": va, "b": vb, "ratio": (va / vb if speed else vb / va)
                     if va and vb else None, "a_run": ra, "b_run": rb})
    out = {"a": median([r["a"] for r in runs]), "b": median([r["b"] for r in runs]),
           "ratio": median([r["ratio"] for r in runs]), "ratios": [r["ratio"] for r in runs],
           "runs": runs}
    ratio = out["ratio"]
    print(f"  {name}: {fmt(out['a'])} / {fmt(out['b'])}, ratio {fmt(ratio)} "
          f"(pairs: {', '.join(fmt(r) for r in out['ratios'])})", file=sys.stderr, flush=True)
    return out


def run_pairs(args, model: Path, vocab: int, work: Path, node_env: dict,
              done: Callable[[dict], None]) -> None:
    """Runs every workload's pairs; `done(result so far)` after each, so that a run cut short
    (a device call's time limit) keeps every row it finished."""
    rng = random.Random(1234)
    hi, lo = vocab - 1, min(100, (vocab - 1) // 2)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    spec = {"timeout": args.timeout}
    server = Server(model, work / "server.log", args.server_arg)
    raw = None
    try:
        ready = server.wait_ready(SERVER_START_TIMEOUT)
        print(f"our server ready in {ready:.1f}s", file=sys.stderr, flush=True)
        raw = RawSide(model, node_env, work / "raw.log")
        url = server.base + "/v1/completions"
        greedy_single, greedy_batch = http_workloads(spec, url, ours_body, work,
                                                     args.client_procs)
        sampled_single, sampled_batch = http_workloads(spec, url, sampled_body, work,
                                                       args.client_procs)
        dec, conc = args.decode_tokens, args.conc_tokens

        def short() -> list[int]:
            return prompt(args.prompt_tokens)

        # (part, key, what, a, b, a fresh input, the field compared, a rate?)
        todo = [("vs_raw", "decode_b1", "batch 1, tok/s, ours / raw",
                 lambda p: greedy_single(p, dec), lambda p: raw.single(p, dec), short,
                 "decode_tps", True)]
        todo += [("vs_raw", f"ttft_{n}", f"TTFT at {n} tokens, s, ours / raw",
                  lambda p: greedy_single(p, args.ttft_tokens),
                  lambda p: raw.single(p, args.ttft_tokens), lambda n=n: prompt(n), "ttft", False)
                 for n in args.ttft_prompts]
        todo += [("vs_raw", f"agg_{c}", f"{c} streams, tok/s, ours / raw",
                  lambda ps: greedy_batch(ps, conc), lambda ps: raw.batch(ps, conc),
                  lambda c=c: [short() for _ in range(c)], "agg_tps", True)
                 for c in args.concurrency]
        todo += [("sampling", "decode_b1", "batch 1, tok/s, sampled / greedy",
                  lambda p: sampled_single(p, dec), lambda p: greedy_single(p, dec), short,
                  "decode_tps", True)]
        todo += [("sampling", f"agg_{c}", f"{c} streams, tok/s, sampled / greedy",
                  lambda ps: sampled_batch(ps, conc), lambda ps: greedy_batch(ps, conc),
                  lambda c=c: [short() for _ in range(c)], "agg_tps", True)
                 for c in args.sampled_concurrency]
        vs_raw, sampling = {}, {}
        for part, key, what, a, b, inputs, field, speed in todo:
            try:
                found = paired(what, a, b, inputs, field,
                               [inputs() for _ in range(args.warmup_runs)], args.pairs, speed)
            except Exception as e:  # one workload's failure (logged) costs only its own row
                print(f"  {what}: failed: {e}\nserver log tail:\n{server.tail()}",
                      file=sys.stderr, flush=True)
                found = {"error": f"{type(e).__name__}: {e}"[:300]}
            (vs_raw if part == "vs_raw" else sampling)[key] = found
            done({"vs_raw": vs_raw, "sampling": sampling, "raw_info": raw.info,
                  "server_ready_s": ready})
    except Exception:
        print(f"server log tail:\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        if raw is not None:
            raw.stop()
        server.stop()


# ---- report -------------------------------------------------------------------------------------


def rows_of(result: dict) -> list[str]:
    """The two tables (ours against raw, sampled against greedy) as markdown lines."""
    labels = {"decode_b1": ("tok/s, batch 1 (end to end)", "tok/s", 0.95)}
    for n in result["settings"]["ttft_prompts"]:
        labels[f"ttft_{n}"] = (f"TTFT, batch 1, {n}-token prompt", "ms", TTFT_GOAL)
    for c in sorted(set(result["settings"]["concurrency"])
                    | set(result["settings"]["sampled_concurrency"])):
        labels[f"agg_{c}"] = (f"aggregate tok/s, {c} streams", "tok/s", 0.9)
    out = []
    for part, head in (("vs_raw", "| metric | ours | raw mlx-lm | ours/raw, median of pairs "
                                  "| goal | each pair |"),
                       ("sampling", "| metric (ours) | sampled | greedy | sampled/greedy, median "
                                    "of pairs | goal | each pair |")):
        out += ["", head, "| --- | ---: | ---: | ---: | ---: | --- |"]
        for key, r in result[part].items():
            label, unit, goal = labels[key]
            scale = 1000 if unit == "ms" else 1
            if part == "sampling":
                goal = 0.9
            if "error" in r:
                out.append(f"| {label} | failed: {r['error']} | | | >= {goal} | |")
                continue
            out.append(f"| {label} | {fmt(r['a'] * scale)} {unit} | {fmt(r['b'] * scale)} "
                       f"{unit} | {fmt(r['ratio'])} | >= {goal} | "
                       f"{', '.join(fmt(x) for x in r['ratios'])} |")
    return out


def markdown(result: dict) -> str:
    m, s, info = result["machine"], result["settings"], result["raw_info"]
    machine = result["machine_note"] or (f"{m['gpu']} ({m['cpu_count']} CPU cores: {m['cpu']})"
                                         if m["gpu"] else f"{m['cpu']} ({m['cpu_count']} cores)")
    lines = [f"# Paired benchmark: omlx-cluster and raw mlx-lm in turns ({result['tag']})", "",
             f"- machine: {machine}; MLX device `{info['device']}`",
             f"- mlx {info['mlx_version']}, mlx-lm {info['mlx_lm_version']}, python "
             f"{m['python']}, commit {m['git_commit']}",
             f"- model: {result['model']['name']} ({result['model']['desc']}), compute dtype "
             f"{info['dtype']}",
             f"- {s['pairs']} pairs a workload after {s['warmup_runs']} warm-up(s) of each "
             f"side, order alternating; prompt {s['prompt_tokens']} tok, batch-1 max_tokens "
             f"{s['decode_tokens']}, concurrent max_tokens {s['conc_tokens']}, TTFT max_tokens "
             f"{s['ttft_tokens']}, {s['client_procs']} load-client processes; server flags "
             f"`{' '.join(s['server_args']) or '(defaults)'}`; {result['bench_seconds']:.0f} s",
             *rows_of(result), "",
             "Ratios > 1: ours (or sampled) is faster; for a time, the other's / ours. Ours is "
             "measured end to end through HTTP streaming, raw mlx-lm in its own process "
             "(`generate_step`, `BatchGenerator`, no HTTP, no detokenising)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--pairs", type=int, default=5, help="timed pairs of each workload")
    ap.add_argument("--warmup-runs", type=int, default=2,
                    help="warm-up runs of each workload on each side (new shapes JIT-compile)")
    ap.add_argument("--sampled-concurrency", type=int, nargs="*", default=[8, 32],
                    help="stream counts of the sampled-against-greedy pairs")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="time limit of one run's load clients, seconds")
    ap.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp folder)")
    ap.add_argument("--_raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._raw:
        raw_child(args._raw)
        return 0

    from omlx_shared.blas import blas_env

    if args.model is None and args.random_llama is None:
        args.random_llama = "small"
    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-paired-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    tag = args.tag or machine_tag(machine)
    model, model_name, desc, config = select_model(args, work, plain_env())
    args.out.mkdir(parents=True, exist_ok=True)
    written = {}

    def write(result: dict) -> None:
        result |= {
            "tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
            "machine_note": args.machine_note,
            "model": {"name": model_name, "desc": desc, "path": str(model)},
            "settings": {k: getattr(args, k) for k in (
                "pairs", "warmup_runs", "decode_tokens", "conc_tokens", "concurrency",
                "sampled_concurrency", "prompt_tokens", "ttft_prompts", "ttft_tokens",
                "client_procs")} | {"server_args": args.server_arg},
            "bench_seconds": round(time.monotonic() - t_start, 1)}
        (args.out / f"paired-{tag}.json").write_text(json.dumps(result, indent=1))
        written["md"] = markdown(result)
        (args.out / f"paired-{tag}.md").write_text(written["md"])

    run_pairs(args, model, int(config["vocab_size"]), work, blas_env(), write)
    print(written["md"])
    print(f"wrote {args.out}/paired-{tag}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
