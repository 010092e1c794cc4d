#!/usr/bin/env python3
"""Where our server's time goes at N concurrent streams: py-spy samples of the gateway, the node
agent and the shard worker while N streams decode, with the streams' decode-phase rate.

    python bench/diag_profile_streams.py --model PATH [--streams 1 8] [--tokens 512] --out DIR
    python bench/diag_profile_streams.py --random-llama 1b --gil --out DIR

Writes DIR/s<N>_profile_<process>.txt (py-spy raw stacks, --nonblocking so the processes run at
full speed, one file per thread kind with --threads) and prints each process's hottest frames,
then each thread's share of a core over the sampling window (/proc ticks). `--gil` samples only
the thread holding the GIL: how the GIL is shared between a worker's engine thread and its
streaming threads, which on a GPU whose steps are bound by the engine's Python is what they
cost the engine. `--idle` keeps the samples of threads that wait (py-spy --idle): where the
engine thread waits (for the device, for the GIL, for work) when it is not busy. Needs py-spy
on PATH.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_single_node as bsn


def hottest(raw: Path, top: int) -> list[tuple[str, int]]:
    """The frames most samples are in (anywhere on the stack), with their sample counts."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        for frame in {f.split(" (")[0] for f in stack.split(";")}:
            counts[frame] += int(n)
    return counts.most_common(top)


def thread_names(raw: Path) -> dict[int, str]:
    """tid -> Python thread name, from a py-spy --threads raw profile."""
    names = {}
    for line in raw.read_text().splitlines():
        head = line.split(";", 1)[0]  # "thread (0x7f...): MainThread" or "thread (123): name"
        if head.startswith("thread (") and "): " in head:
            tid, name = head[len("thread ("):].split("): ", 1)
            names[int(tid, 0)] = name
    return names


def by_thread(raw: Path) -> list[tuple[str, int]]:
    """Samples per Python thread of a py-spy --threads raw profile, most first."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[stack.split(";", 1)[0]] += int(n)
    return counts.most_common()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--streams", type=int, nargs="+", default=[8])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seconds", type=int, default=4, help="how long py-spy samples")
    ap.add_argument("--gil", action="store_true",
                    help="sample only the thread holding the GIL (py-spy --gil)")
    ap.add_argument("--idle", action="store_true",
                    help="keep the samples of waiting threads too (py-spy --idle)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not on PATH (pip install py-spy)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="omlx-profile-"))
    model, _, _, config = bsn.select_model(args, work, dict(os.environ))
    rng = random.Random(5)
    server = bsn.Server(model, work / "server.log", [])
    hz = os.sysconf("SC_CLK_TCK")
    try:
        server.wait_ready(bsn.SERVER_START_TIMEOUT)
        _, batch = bsn.http_workloads({"timeout": 300}, server.base + "/v1/completions",
                                      bsn.ours_body, work, 4)
        for streams in args.streams:
            prompts = [[rng.randrange(100, int(config["vocab_size"]) - 1) for _ in range(32)]
                       for _ in range(streams)]
            profile(args, streams, prompts, batch, server, hz)
    finally:
        server.stop()
    return 0


def profile(args: argparse.Namespace, streams: int, prompts: list[list[int]], batch,
            server: bsn.Server, hz: int) -> None:
    """One stream count: a warm-up, an unprofiled run, then a run sampled while it decodes."""
    print(f"=== {streams} streams", flush=True)
    batch(prompts, 64)  # warm-up: this batch size's kernels
    print("unprofiled:", round(batch(prompts, args.tokens)["agg_tps"], 1), "tok/s", flush=True)
    names = {pid: bsn.proc_ticks(pid)[0].split()[-1] for pid in server.pids()
             if bsn.proc_ticks(pid)}
    spies, ticks = [], {}

    def sample() -> None:
        ticks.update({pid: (time.perf_counter(), bsn.thread_ticks(pid)) for pid in names})
        for pid, name in names.items():
            raw = args.out / f"s{streams}_profile_{name}_{pid}.txt"
            spies.append((pid, name, raw, subprocess.Popen(
                ["py-spy", "record", "-p", str(pid), "-d", str(args.seconds), "-r", "200",
                 "-f", "raw", "--nonblocking", "--threads", *(["--gil"] if args.gil else []),
                 *(["--idle"] if args.idle else []),
                 "-o", str(raw)], stdout=subprocess.DEVNULL)))

    timer = threading.Timer(0.5, sample)  # once every stream decodes
    timer.start()
    print("profiled:", round(batch(prompts, args.tokens)["agg_tps"], 1), "tok/s", flush=True)
    timer.join()
    for pid, name, raw, p in spies:
        p.wait(60)
        if not raw.exists():
            continue
        print(f"== {name} ({raw.name})")
        for frame, n in hottest(raw, 40):
            print(f"  {n:6d} {frame[:110]}")
        print("  samples by thread:")
        for thread, n in by_thread(raw):
            print(f"  {n:6d} {thread}")
    # Ticks from the sampling's start to the end of the run: each thread's share of a core.
    for pid, name in names.items():
        if pid not in ticks:
            continue
        start, before = ticks[pid]
        after, span = bsn.thread_ticks(pid), time.perf_counter() - start
        raw = args.out / f"s{streams}_profile_{name}_{pid}.txt"
        tnames = thread_names(raw) if raw.exists() else {}
        busy = sorted(((after[t][1] - before.get(t, ('', 0))[1]) / hz / span, t)
                      for t in after)
        print(f"== {name} {pid}: % of a core by thread over {span:.1f} s")
        for share, t in reversed(busy[-8:]):
            print(f"  {100 * share:6.1f}% {t} {tnames.get(t, '')}")


if __name__ == "__main__":
    raise SystemExit(main())
