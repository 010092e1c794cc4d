#!/usr/bin/env python3
"""Where our server's time goes at N concurrent streams: py-spy samples of the gateway, the node
agent and the shard worker while N streams decode, with the streams' decode-phase rate.

    python bench/diag_profile_streams.py --model PATH [--streams 8] [--tokens 512] --out DIR
    python bench/diag_profile_streams.py --random-llama 1b --out DIR

Writes DIR/profile_<process>.txt (py-spy raw stacks, --nonblocking so the processes run at full
speed) and prints each process's hottest frames. Needs py-spy on PATH.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bsn.add_model_args(ap)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seconds", type=int, default=4, help="how long py-spy samples")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not on PATH (pip install py-spy)")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="omlx-profile-"))
    model, _, _, config = bsn.select_model(args, work, dict(os.environ))
    rng = random.Random(5)
    prompts = [[rng.randrange(100, int(config["vocab_size"]) - 1) for _ in range(32)]
               for _ in range(args.streams)]
    server = bsn.Server(model, work / "server.log", [])
    try:
        server.wait_ready(bsn.SERVER_START_TIMEOUT)
        _, batch = bsn.http_workloads({"timeout": 300}, server.base + "/v1/completions",
                                      bsn.ours_body, work, 4)
        batch(prompts, 64)  # warm-up: this batch size's kernels
        print("unprofiled:", round(batch(prompts, args.tokens)["agg_tps"], 1), "tok/s",
              flush=True)
        names = {pid: bsn.proc_ticks(pid)[0].split()[-1] for pid in server.pids()
                 if bsn.proc_ticks(pid)}
        spies = []

        def sample() -> None:
            for pid, name in names.items():
                raw = args.out / f"profile_{name}_{pid}.txt"
                spies.append((name, raw, subprocess.Popen(
                    ["py-spy", "record", "-p", str(pid), "-d", str(args.seconds), "-r", "200",
                     "-f", "raw", "--nonblocking", "-o", str(raw)],
                    stdout=subprocess.DEVNULL)))

        timer = threading.Timer(0.5, sample)  # once every stream decodes
        timer.start()
        print("profiled:", round(batch(prompts, args.tokens)["agg_tps"], 1), "tok/s", flush=True)
        timer.join()
        for name, raw, p in spies:
            p.wait(60)
            if raw.exists():
                print(f"== {name} ({raw.name})")
                for frame, n in hottest(raw, 40):
                    print(f"  {n:6d} {frame[:110]}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
