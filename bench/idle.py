#!/usr/bin/env python3
"""An idle cluster costs nothing, and wakes within a step: every process's CPU over a window
with no request in flight, and the first token after idling against the first token of a
request sent while the cluster is warm, in one run, for two setups on this machine:

- `serve --nodes 2`: a 2-stage pipeline of one gateway and two node agents with their workers;
- `coordinator --no-discovery` and two `join --coordinator --no-announce` nodes (loopback only:
  nothing is announced or browsed), each with a home of its own.

Per setup: warm-up; `--warm` requests 0.2 s apart (warm TTFT, and the gap between tokens: one decode
step, as the client sees it); `--windows` idle windows of `--idle-seconds` each, back to back,
measured from /proc/<pid>/stat ticks; then `--wakes` times: `--wake-idle` seconds with nothing in
flight and one request (TTFT after idling). Prints each process's idle CPU (% of one core; goal <=
2) and the wake delay (TTFT after idling minus warm TTFT) in steps (goal <= 1).

    python -m bench.idle [--random-llama 1b] [--idle-seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    RANDOM_LLAMAS,
    Server,
    free_port,
    idle_cpu,
    process_tree,
    scratch_model,
    stream_one,
    with_repo_path,
)

# Random: `coordinator` refuses a secret a guesser could find (omlx_shared/secret_strength.py).
SECRET = secrets.token_urlsafe(32)


class JoinedCluster:
    """`omlx-cluster coordinator` and `join`ed nodes on loopback, each in its own session."""

    def __init__(self, model: Path, work: Path, nodes: int, extra: tuple[str, ...] = (),
                 cores: tuple[int, ...] = (), node_extra: tuple[str, ...] = ()):
        """`extra`: more coordinator flags; `node_extra`: more join flags; `cores`: node i's
        join (and so its worker) runs pinned to CPU core cores[i] (taskset)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "coordinator.log"
        self.logs, self.procs = [], []
        env = with_repo_path(dict(os.environ))
        self._start([sys.executable, "-m", "omlx_cluster", "coordinator", "--model", str(model),
                     "--model-id", "bench", "--port", str(self.port), "--secret", SECRET,
                     "--no-discovery", "--log-level", "warning", *extra],
                    dict(env, OMLX_CLUSTER_HOME=str(work / "coordinator")), self.log_path)
        for i in range(nodes):
            home = work / f"node{i}"
            pin = ["taskset", "-c", str(cores[i])] if cores else []
            self._start([*pin, sys.executable, "-m", "omlx_cluster", "join", "--coordinator",
                         f"127.0.0.1:{self.port}", "--no-announce", "--secret", SECRET,
                         "--port", str(free_port()), "--name", f"bench-node-{i}",
                         "--speed", "5", "--log-level", "warning", *node_extra],
                        dict(env, OMLX_CLUSTER_HOME=str(home)), work / f"node{i}.log")

    def _start(self, cmd: list[str], env: dict, log: Path) -> None:
        f = open(log, "wb")
        self.logs.append(f)
        self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))

    def wait_ready(self, timeout: float, nodes: int) -> float:
        """Until the model is served by a plan over `nodes` nodes. Not merely members: the
        coordinator serves on the first node to join, then re-plans for the next (its workers
        reload, which held one warm request of an earlier run ~17 s on the H200)."""
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a process exited ({p.returncode}): {p.args[:4]}")
            try:
                r = httpx.get(self.base + "/health", timeout=2.0)
                if r.status_code == 200 and held_stages(r.json()) >= nodes:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the cluster was not ready within {timeout:.0f}s")

    def pids(self) -> list[int]:
        return [pid for p in self.procs for pid in process_tree(p.pid)]

    def stop(self) -> None:
        for p in reversed(self.procs):  # nodes last: the coordinator lets go of them first
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in self.logs:
            f.close()


def held_stages(health: dict) -> int:
    """How many nodes of a /health answer hold a stage of the model."""
    return sum(1 for n in health.get("nodes", []) if n.get("layers"))


def stages(base: str) -> int:
    import httpx

    return held_stages(httpx.get(base + "/health", timeout=5).json())


async def requests(base: str, prompts: list[list[int]], tokens: int, gap: float,
                   idle_first: float = 0.0) -> list[dict]:
    """One request per prompt, one after another: `idle_first` seconds of nothing before each
    (the wake case), else `gap` seconds between them. Each on a connection of its own, in both
    cases: uvicorn closes one idle for 5 s, so a client back after a pause connects again."""
    import httpx

    out = []
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=fresh) as client:
        for p in prompts:
            await asyncio.sleep(idle_first or gap)
            out.append(await stream_one(client, base, p, tokens))
    return out


def measure(name: str, cluster, args, vocab: int, rng: random.Random) -> dict:
    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(10, vocab) for _ in range(args.prompt)] for _ in range(n)]

    asyncio.run(requests(cluster.base, prompts(3), args.tokens, 0.2))  # warm-up
    warm = asyncio.run(requests(cluster.base, prompts(args.warm), args.tokens, 0.2))
    gaps = [b - a for r in warm for a, b in zip(r["times"], r["times"][1:])]
    time.sleep(1.0)  # the last stream's teardown
    # Back to back: a process still starting up (an agent spawns its standby worker right
    # after a load) shows in the first window only; what idling costs shows in every one.
    windows = [{p["pid"]: p for p in idle_cpu(cluster, args.idle_seconds)}
               for _ in range(args.windows)]
    cpu = [dict(p, windows=[w[pid]["cpu_percent"] if pid in w else None for w in windows],
                cpu_percent=windows[-1].get(pid, {}).get("cpu_percent"))
           for pid, p in windows[0].items()]
    woken = asyncio.run(requests(cluster.base, prompts(args.wakes), args.tokens, 0.0,
                                 idle_first=args.wake_idle))
    step = statistics.median(gaps)
    warm_ttft = statistics.median(r["ttft"] for r in warm)
    wake_ttft = statistics.median(r["ttft"] for r in woken)
    return {"setup": name, "stages": stages(cluster.base), "idle_cpu": cpu,
            "warm_ttft_ms": warm_ttft * 1e3, "wake_ttft_ms": wake_ttft * 1e3,
            "warm_ttfts_ms": [r["ttft"] * 1e3 for r in warm],
            "wake_ttfts_ms": [r["ttft"] * 1e3 for r in woken], "step_ms": step * 1e3,
            "wake_delay_steps": (wake_ttft - warm_ttft) / step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS),
                    help="a random llama of that shape (default: a tiny 4-layer test llama)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: 64)")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens (default: 16)")
    ap.add_argument("--warm", type=int, default=8, help="warm requests (default: 8)")
    ap.add_argument("--idle-seconds", type=float, default=30.0,
                    help="the idle-CPU window (default: 30)")
    ap.add_argument("--windows", type=int, default=2,
                    help="idle windows back to back; the last is the figure (default: 2)")
    ap.add_argument("--wakes", type=int, default=3, help="requests after idling (default: 3)")
    ap.add_argument("--wake-idle", type=float, default=10.0,
                    help="seconds idle before each of them (default: 10)")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        model, vocab = scratch_model(work, args.random_llama, 4 * (args.prompt + args.tokens),
                                  num_layers=4)
        rng = random.Random(0)
        setups = {
            "serve --nodes 2": lambda: Server(model, work / "serve.log", ["--nodes", "2"]),
            "coordinator + 2 x join": lambda: JoinedCluster(model, work, 2)}
        for name, start in setups.items():
            print(f"== {name} ==", file=sys.stderr, flush=True)
            cluster = start()
            try:
                if isinstance(cluster, JoinedCluster):
                    cluster.wait_ready(600, 2)
                else:
                    cluster.wait_ready(600)
                results.append(measure(name, cluster, args, vocab, rng))
            except Exception:
                print(Path(cluster.log_path).read_text(errors="replace")[-3000:],
                      file=sys.stderr)
                raise
            finally:
                cluster.stop()
    print(f"model {args.random_llama or 'tiny (4 layers)'}; idle window {args.idle_seconds:.0f} "
          f"s; {args.wakes} wakes after {args.wake_idle:.0f} s idle each\n")
    print("| setup | process | idle CPU, % of a core, window by window (goal <= 2) |\n"
          "|---|---|---:|")
    for r in results:
        for p in r["idle_cpu"]:
            print(f"| {r['setup']} | {p['name']} (pid {p['pid']}) | "
                  f"{' / '.join('gone' if x is None else f'{x:.2f}' for x in p['windows'])} |")
    print("\n| setup | stages | warm TTFT, median (min-max) | TTFT after idling, median "
          "(each) | one step | wake delay, steps (goal <= 1) |\n|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['setup']} | {r['stages']} | {r['warm_ttft_ms']:.1f} ms "
              f"({min(r['warm_ttfts_ms']):.1f}-{max(r['warm_ttfts_ms']):.1f}) | "
              f"{r['wake_ttft_ms']:.1f} ms ({', '.join(f'{x:.1f}' for x in r['wake_ttfts_ms'])})"
              f" | {r['step_ms']:.1f} ms | {r['wake_delay_steps']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
