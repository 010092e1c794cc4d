"""What the rebalancer wins back when a pipeline stage's machine gets slow.

Serves a tiny model as 3 stages on this machine (`serve --nodes 3 --rebalance auto`, short
window), runs 8 greedy streams, slows one node (its agent and shard worker) by a cgroup v1 CPU
quota partway through, and measures: aggregate tok/s before the slowdown, throttled, and after
the rebalancer's move; the time from the slowdown to the move; the longest pause a client saw;
and that every output equals an undisturbed run. The planner's prediction for the move is the
throttled tok/s times the predicted bottleneck gain (current / best) the move was made on.

    sudo python -m bench.rebalance [--throttle 0.1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench.common import RESULTS
from tests.conftest import start_server
from tests.helpers.rebalance import (
    LIVE_FLAGS,
    cgroup_unavailable,
    cpu_quota,
    references,
    status,
    Streams,
)
from tests.tiny_models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--throttle", type=float, default=0.1, help="CPU share left to the node")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--machine", default=platform.node(), help="what to call this machine")
    args = ap.parse_args()
    if (why := cgroup_unavailable()) is not None:
        sys.exit(f"cannot throttle: {why}")
    work = Path(tempfile.mkdtemp(prefix="bench-rebalance-"))
    model = build_model(work / "tiny-rb", "llama", num_layers=6, hidden_size=256, seed=5)
    with start_server(model, *LIVE_FLAGS, home=work / "h", keepalive=None) as server:
        refs = references(server.url, model.name)
        before = status(server.url)
        slow = before["nodes"][1]
        streams = Streams(server.url, model.name)
        while min(streams.progress) < 20:
            time.sleep(0.05)
        t_start = time.monotonic()
        time.sleep(2)
        with cpu_quota([slow["agent_pid"], slow["worker_pid"]], args.throttle):
            t_throttle = time.monotonic()
            deadline = t_throttle + 120
            while time.monotonic() < deadline:
                after = status(server.url)
                if after["epoch"] > before["epoch"] and after["ready"]:
                    break
                time.sleep(0.2)
            else:
                sys.exit("the rebalancer did not move within 120 s")
            t_move = time.monotonic()
            streams.join()
        advice = httpx.get(server.url + "/cluster/rebalance", timeout=30).json()
    times = sorted(streams.times)
    end = times[-1]
    unthrottled = streams.rate(t_start, t_throttle)
    throttled = streams.rate(t_throttle + 2, t_move - 0.5)
    moved = streams.rate(t_move + 1, end)
    move = advice["last_move"]
    # What the move was decided on: the bottleneck measured, and the one predicted.
    predicted = throttled * move["current_bottleneck_seconds"] / move["best_bottleneck_seconds"]
    pause = max(b - a for a, b in itertools.pairwise(times) if t_throttle <= a <= end)
    result = {
        "machine": args.machine, "cpus": os.cpu_count(),
        "model": "tiny llama, 6 layers, hidden 256 (tests/tiny_models.py)",
        "stages": 3, "streams": len(refs), "throttle_cpu_share": args.throttle,
        "flags": list(LIVE_FLAGS),
        "tok_s_before": unthrottled, "tok_s_throttled": throttled, "tok_s_after_move": moved,
        "tok_s_predicted_after_move": predicted,
        "after_vs_throttled": moved / throttled if throttled else None,
        "after_vs_predicted": moved / predicted if predicted else None,
        "slowdown_to_move_seconds": t_move - t_throttle, "move_load_seconds": move["seconds"],
        "longest_client_pause_seconds": pause,
        "split_before": [n["layers"] for n in before["nodes"]],
        "split_after": [n["layers"] for n in after["nodes"]],
        "decision": move["why"], "outputs_identical": streams.texts == refs,
        "errors": streams.errors,
    }
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rebalance-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "rebalance-cpu.md").write_text(f"""# Rebalance on one slowed stage ({args.machine})

Machine: {args.machine}, {result['cpus']} CPU cores, a VM shared with other engineers' work
(numbers move with their load). {result['model']}, 3 local stages, {len(refs)} greedy streams;
node {slow['id']} (agent and shard worker) limited to {args.throttle:.0%} of one CPU by a cgroup
v1 quota partway through. Flags: `{' '.join(LIVE_FLAGS)}`.

| | tok/s |
| --- | ---: |
| before the slowdown | {unthrottled:.0f} |
| throttled | {throttled:.0f} |
| after the move | {moved:.0f} |
| planner's prediction after the move | {predicted:.0f} |

- after / throttled: {result['after_vs_throttled']:.2f}x (goal >= 1.3x)
- after / predicted: {result['after_vs_predicted']:.2f}x (goal within 10%)
- slowdown to move: {t_move - t_throttle:.1f} s (window 6 s); the move's re-plan
  {move['seconds']:.2f} s; the longest pause a client saw {pause:.2f} s
- split {result['split_before']} -> {result['split_after']}
- outputs identical to an undisturbed run: {result['outputs_identical']}; errors:
  {len(streams.errors)}
- decision: {move['why']}
""")


if __name__ == "__main__":
    main()
