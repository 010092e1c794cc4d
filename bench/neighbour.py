"""The cost of a neighbour: a chat model's decode tok/s alone, while another model loads on the
same node, and while an embedding batch runs there (the issue's goal: >= 0.9x alone in both).

One `omlx-cluster serve` with chat model A (8 streams looping greedy completions), chat model
B (1.2 GB of float32 weights: its load takes a while) and an embedding model E. Per round:
A's tok/s over 3 s with B unloaded; over the window in which B loads (POST
/cluster/models/B/load until it answers: the worker's start, imports, weights and warm-up);
and over 3 s of E embedding batches of 64 inputs back to back. A's rate is the gateway's own
token counter over each window (bench/models.py's `rate_during`).

Twice in one run, so that before and after meet the same machine: with loads and embedding
passes at the workers' own priority (OMLX_LOAD_NICE=0 OMLX_ENCODE_NICE=0, as before the fix),
and as shipped (a load runs at nice LOAD_NICE, an embedding worker at ENCODE_NICE:
omlx_node/load_priority.py).

    python -m bench.neighbour [--runs 2] [--out bench/results/neighbour-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import git_commit  # noqa: E402
from bench.models import rate_during  # noqa: E402
from omlx_node.load_priority import ENCODE_NICE, LOAD_NICE  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.tiny_encoders import build_encoder  # noqa: E402
from tests.tiny_models import build_model  # noqa: E402

SETTINGS = (("before: OMLX_LOAD_NICE=0 OMLX_ENCODE_NICE=0", "0"),
            (f"as shipped: loads at nice {LOAD_NICE}, embedding workers at nice {ENCODE_NICE}",
             ""))
NICE_VARS = ("OMLX_LOAD_NICE", "OMLX_ENCODE_NICE")


def embed_for(url: str, seconds: float) -> None:
    """Embedding batches of 64 inputs of ~100 tokens, back to back, for `seconds`."""
    batch = [[5 + (i * 7 + j) % 300 for j in range(100)] for i in range(64)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        httpx.post(url + "/v1/embeddings", json={"model": "e", "input": batch},
                   timeout=120).raise_for_status()


def measure(work: Path, a: Path, b: Path, e: Path, nice: str, runs: int) -> dict:
    for var in NICE_VARS:
        os.environ.pop(var, None)
        if nice:
            os.environ[var] = nice
    out: dict[str, list[float]] = {"alone": [], "loading": [], "embedding": [], "window": []}
    with start_server(a, "--model", f"b={b}", "--model", f"e={e}",
                      home=work / f"home-{nice or 'default'}", keepalive=None) as server:
        embed_for(server.url, 0.1)  # E loaded and warm
        for _ in range(runs):
            httpx.post(f"{server.url}/cluster/models/b/unload", timeout=60).raise_for_status()
            out["alone"].append(rate_during(server.url, a.name, lambda: time.sleep(3.0))[0])
            rate, window = rate_during(server.url, a.name, lambda: httpx.post(
                f"{server.url}/cluster/models/b/load", timeout=600).raise_for_status())
            out["loading"].append(rate)
            out["window"].append(window)
            out["embedding"].append(rate_during(server.url, a.name,
                                                lambda: embed_for(server.url, 3.0))[0])
    for var in NICE_VARS:
        os.environ.pop(var, None)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/neighbour-cpu.md")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench-neighbour-"))
    a = build_model(work / "model-a", "llama", num_layers=8, hidden_size=256, seed=1)
    b = build_model(work / "model-b", "qwen3", num_layers=24, hidden_size=1024, seed=2)
    e = build_encoder(work / "e", "bert", hidden_size=256, num_layers=4, max_positions=512)
    rows = []
    for label, nice in SETTINGS:
        r = measure(work, a, b, e, nice, args.runs)
        rows.append((label, r))
        print(f"{label}: A alone {r['alone']:.0f} tok/s, while B loads {r['loading']:.0f} "
              f"({r['loading'] / r['alone']:.2f}x, {r['window']:.1f} s), while E embeds "
              f"{r['embedding']:.0f} ({r['embedding'] / r['alone']:.2f}x)", flush=True)
    commit = git_commit()
    lines = [
        "# A chat model's decode beside a loading model and an embedding batch (CPU)", "",
        f"Machine: {platform.machine()} {platform.system()}, MLX CPU backend, 2 cores shared "
        f"with other engineers' work (load average {load_before:.1f} before the run, "
        f"{os.getloadavg()[0]:.1f} after). Commit {commit}. "
        f"`python -m bench.neighbour --runs {args.runs}`.", "",
        "A: random llama, 8 layers, hidden 256, 8 streams of 32-token greedy completions. "
        "B: random qwen3, 24 layers, hidden 1024 (1.2 GB float32). E: random BERT, 4 layers, "
        f"hidden 256, batches of 64 inputs of 100 tokens. Medians of {args.runs} rounds; one "
        "`serve` per setting, one after the other.", "",
        "| setting | A alone tok/s | while B loads | ratio | B's load window | while E embeds "
        "| ratio |", "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {label} | {r['alone']:.0f} | {r['loading']:.0f} | {r['loading'] / r['alone']:.2f}x"
          f" | {r['window']:.1f} s | {r['embedding']:.0f} | {r['embedding'] / r['alone']:.2f}x |"
          for label, r in rows), ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
