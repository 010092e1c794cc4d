#!/usr/bin/env python3
"""The stream interval's claim: where a node decodes faster than the interval (a small model on a
GPU), sending the steps of one interval as one message makes its streams faster and cheaper.

Two of our servers on one model stay up for the whole run: A with `--stream-interval 0` (a
message whenever a step has news, as before the interval), B with `--stream-interval MS`
(default: the server's default). Each pair runs the same batch-1 stream, and with
`--concurrency` the same N streams, on A and on B, in alternating order, so that a host whose
speed drifts moves both alike (the idle server costs nothing meanwhile). Prints each pair's
rate ratio B/A and their median, and each side's CPU milliseconds per generated token, by
process (from /proc), over its timed runs: what the messages cost the gateway and the worker.

    python -m bench.stream_interval --random-llama 1b --pairs 15     # GPU
    python -m bench.stream_interval --random-llama small --pairs 9   # CPU

Results: bench/results/stream-interval-<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    RESULTS,
    SERVER_START_TIMEOUT,
    Server,
    add_model_args,
    fmt,
    machine_info,
    machine_tag,
    ours_body,
    plain_env,
    proc_ticks,
    select_model,
)
from bench.load_client import http_workloads
from bench.paired import paired


class Side:
    """One server and its workloads, counting its processes' CPU over the timed runs."""

    def __init__(self, name: str, server: Server, work: Path, procs: int):
        self.name, self.server = name, server
        self.single, self.batch = http_workloads({"timeout": 600.0},
                                                 server.base + "/v1/completions", ours_body,
                                                 work, procs)
        self.cpu: dict[str, int] = {}  # clock ticks by process name
        self.tokens = 0

    def timed(self, run, *args) -> dict:
        before = {pid: t for pid in self.server.pids() if (t := proc_ticks(pid))}
        out = run(*args)
        for pid, (name, ticks) in before.items():
            if (after := proc_ticks(pid)) is not None:
                self.cpu[name] = self.cpu.get(name, 0) + after[1] - ticks
        self.tokens += out["tokens"]
        return out

    def cpu_ms_a_token(self) -> dict[str, float]:
        hz = os.sysconf("SC_CLK_TCK")
        return {name: round(1000 * ticks / hz / max(1, self.tokens), 3)
                for name, ticks in sorted(self.cpu.items()) if ticks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--interval", type=float, default=None,
                    help="B's --stream-interval, ms (default: the server's default)")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--decode-tokens", type=int, default=512, help="max_tokens at batch 1")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[8])
    ap.add_argument("--conc-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu from the machine)")
    ap.add_argument("--work-dir", type=Path, help="scratch folder (default: a temp folder)")
    args = ap.parse_args()
    if args.model is None and args.random_llama is None:
        args.random_llama = "small"
    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-interval-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    tag = args.tag or machine_tag(machine)
    model, model_name, desc, config = select_model(args, work, plain_env())
    b_args = [] if args.interval is None else ["--stream-interval", str(args.interval)]
    servers = [Server(model, work / "a.log", ["--stream-interval", "0"]),
               Server(model, work / "b.log", b_args)]
    rng = random.Random(1234)
    hi = int(config["vocab_size"]) - 1
    lo = min(100, hi // 2)

    def prompt() -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]

    rows = {}
    try:
        for s in servers:
            print(f"server ready in {s.wait_ready(SERVER_START_TIMEOUT):.1f}s", file=sys.stderr)
        a, b = (Side(n, s, work, args.client_procs) for n, s in zip("AB", servers))
        dec = args.decode_tokens
        rows["batch 1"] = paired("batch 1, tok/s, B / A",
                                 lambda p: b.timed(b.single, p, dec),
                                 lambda p: a.timed(a.single, p, dec), prompt, "decode_tps",
                                 [prompt()], args.pairs, True)
        for c in args.concurrency:
            rows[f"{c} streams"] = paired(
                f"{c} streams, tok/s, B / A",
                lambda ps: b.timed(b.batch, ps, args.conc_tokens),
                lambda ps: a.timed(a.batch, ps, args.conc_tokens),
                lambda c=c: [prompt() for _ in range(c)], "agg_tps",
                [[prompt() for _ in range(c)]], args.pairs, True)
        cpu = {"A": a.cpu_ms_a_token(), "B": b.cpu_ms_a_token()}
    finally:
        for s in servers:
            s.stop()
    for r in rows.values():
        r.pop("runs")
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "model": {"name": model_name, "desc": desc}, "b_args": b_args,
              "settings": {k: getattr(args, k) for k in ("pairs", "decode_tokens",
                                                          "concurrency", "conc_tokens")},
              "rows": rows, "cpu_ms_a_token": cpu,
              "bench_seconds": round(time.monotonic() - t_start, 1)}
    m = machine
    lines = [f"# Stream interval: A `--stream-interval 0`, B `{' '.join(b_args) or 'default'}` "
             f"({tag})", "",
             f"- machine: {m['gpu'] or m['cpu']} ({m['cpu_count']} CPU cores: {m['cpu']}); "
             f"commit {m['git_commit']}",
             f"- model: {model_name} ({desc})",
             f"- {args.pairs} pairs a workload, order alternating; batch-1 max_tokens {dec}, "
             f"concurrent max_tokens {args.conc_tokens}; {result['bench_seconds']:.0f} s", "",
             "| workload | B | A | B/A, median of pairs | each pair |",
             "| --- | ---: | ---: | ---: | --- |"]
    lines += [f"| {k} | {fmt(r['a'])} tok/s | {fmt(r['b'])} tok/s | {fmt(r['ratio'])} | "
              f"{', '.join(fmt(x) for x in r['ratios'])} |" for k, r in rows.items()]
    lines += ["", "| CPU ms a generated token | A | B |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {cpu['A'].get(name, 0)} | {cpu['B'].get(name, 0)} |"
              for name in sorted(set(cpu["A"]) | set(cpu["B"]))]
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"stream-interval-{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"stream-interval-{tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
