"""The cost of a neighbour: a chat model's decode tok/s alone, while another model loads on the
same node, and while an embedding batch runs there (the issue's goal: >= 0.9x alone in both);
and what an embedding model's own speed pays for its priority.

One `omlx-cluster serve` per setting with chat model A (8 streams looping greedy completions),
chat model B (1.2 GB of float32 weights: its load takes a while) and an embedding model E. Per
round, A's tok/s (the gateway's own token counter, bench/models.py's `rates_during`) over 2 s
with B unloaded, first and last (their mean is A alone); over the window in which B is
preloaded (POST /cluster/models/B/load until it answers: nobody waits for it, LOAD_PRELOAD);
over the window in which B loads for a request (a completion naming B until it answers:
LOAD_REQUESTED), the two in turn first; and over 3 s of E embedding batches of 64
inputs back to back. E's inputs/s over those 3 s, and the median latency of 5 one-input
embeddings (a RAG query's) while A decodes, then E's inputs/s with A idle.

Settings, one after the other on the same machine (`--settings`, by key): every load and
embedding pass at the workers' own priority (`zero`: the nice variables 0, as before the fix);
loads at their nice values only (`nice`: OMLX_LOAD_IDLE=0); as shipped (`shipped`: omlx_node/
load_priority.py: a preload at BACKGROUND_LOAD_NICE, a requested load at LOAD_NICE, both in
the SCHED_IDLE class, embedding workers at ENCODE_NICE); and embedding workers at nice 19
(`encode19`), to decide theirs.

    python -m bench.neighbour [--runs 2] [--settings zero,nice,shipped,encode19]
                              [--out bench/results/neighbour-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import git_commit  # noqa: E402
from bench.models import complete, rates_during  # noqa: E402
from omlx_node.load_priority import BACKGROUND_LOAD_NICE, ENCODE_NICE, LOAD_NICE  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.tiny_encoders import build_encoder  # noqa: E402
from tests.tiny_models import build_model  # noqa: E402

NICE_VARS = ("OMLX_LOAD_NICE", "OMLX_BACKGROUND_LOAD_NICE", "OMLX_ENCODE_NICE")
PRIORITY_VARS = (*NICE_VARS, "OMLX_LOAD_IDLE")
BATCH = [[5 + (i * 7 + j) % 300 for j in range(100)] for i in range(64)]
QUERIES = 5
SETTLE_SECONDS = 4.0
ALONE_SECONDS = 2.0


@dataclass(frozen=True)
class Setting:
    key: str  # its name for --settings
    label: str
    env: dict[str, str]
    loads: tuple[str, ...]  # which loads of B to time beside A: "preload", "requested"


SETTINGS = (
    # At nice 0 both reasons load alike: one is timed.
    Setting("zero", "before: OMLX_LOAD_NICE=0 OMLX_BACKGROUND_LOAD_NICE=0 OMLX_ENCODE_NICE=0",
            dict.fromkeys(NICE_VARS, "0"), ("preload",)),
    Setting("nice", f"nice only (OMLX_LOAD_IDLE=0): preloads at nice {BACKGROUND_LOAD_NICE}, "
            f"requested loads at nice {LOAD_NICE}, embedding workers at nice {ENCODE_NICE}",
            {"OMLX_LOAD_IDLE": "0"}, ("preload", "requested")),
    Setting("shipped", f"as shipped: preloads SCHED_IDLE at nice {BACKGROUND_LOAD_NICE}, "
            f"requested loads at nice {LOAD_NICE}, embedding workers at nice {ENCODE_NICE}",
            {}, ("preload", "requested")),
    Setting("encode19", "as shipped but OMLX_ENCODE_NICE=19", {"OMLX_ENCODE_NICE": "19"}, ()),
)


def embed_for(url: str, seconds: float) -> float:
    """Embedding batches of 64 inputs of ~100 tokens, back to back, for `seconds`; inputs/s."""
    t0, n = time.monotonic(), 0
    while time.monotonic() < t0 + seconds:
        httpx.post(url + "/v1/embeddings", json={"model": "e", "input": BATCH},
                   timeout=120).raise_for_status()
        n += len(BATCH)
    return n / (time.monotonic() - t0)


def query_ms(url: str) -> float:
    """The median latency of one-input embeddings, one after the other."""
    times = []
    for i in range(QUERIES):
        t0 = time.perf_counter()
        httpx.post(url + "/v1/embeddings", json={"model": "e", "input": BATCH[i]},
                   timeout=120).raise_for_status()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(work: Path, a: Path, b: Path, e: Path, setting: Setting, runs: int) -> dict:
    for var in PRIORITY_VARS:
        os.environ.pop(var, None)
    os.environ.update(setting.env)
    out: dict[str, list[float]] = {}
    home = work / f"home-{len(list(work.glob('home-*')))}"
    with start_server(a, "--model", f"b={b}", "--model", f"e={e}", home=home,
                      keepalive=None) as server:
        url = server.url

        def unload_b() -> None:
            httpx.post(f"{url}/cluster/models/b/unload", timeout=60).raise_for_status()

        def settle() -> None:
            """B unloaded, and the node's standby worker (started after each load, importing
            MLX at the background load's nice for a second or two of a core) given time to be
            ready before the next load: else a load right after another pays for that import
            (a preload waits for it; a requested load starts a fresh worker) and a lone one
            does not."""
            unload_b()
            time.sleep(SETTLE_SECONDS)

        niced: dict[str, float] = {}

        def loader(kind: str):
            def load() -> None:
                if kind == "preload":
                    httpx.post(f"{url}/cluster/models/b/load", timeout=600).raise_for_status()
                else:
                    complete(url, "b", [5, 6, 7], 1)
                # The nice value B's loading thread read, as its node reported it.
                status = httpx.get(url + "/cluster/status", timeout=10).json()
                niced[kind] = next(m for m in status["models"] if m["id"] == "b")[
                    "replicas"][0]["load"]["nice"]
            return load

        embedded: dict[str, float] = {}

        def embed() -> None:
            embedded["beside"] = embed_for(url, 3.0)
            embedded["query_ms"] = query_ms(url)

        embed_for(url, 0.1)  # E loaded and warm
        for i in range(runs):
            # One warm-up of A's streams for every window of the round. A alone first and
            # last, B unloaded: their mean is the round's baseline, which follows the other
            # work on a shared machine better than either. The loads take turns at going
            # first: the second of two loads in a row ran slower, whichever it was.
            loads = setting.loads[::-1] if i % 2 else setting.loads
            steps = [(unload_b, lambda: time.sleep(ALONE_SECONDS)),
                     *((settle, loader(kind)) for kind in loads), (None, embed),
                     (unload_b, lambda: time.sleep(ALONE_SECONDS))]
            rates = rates_during(url, a.name, steps)
            out.setdefault("alone", []).append((rates[0][0] + rates[-1][0]) / 2)
            for kind, (rate, window) in zip(loads, rates[1:]):
                out.setdefault(kind, []).append(rate)
                out.setdefault(f"{kind}_window", []).append(window)
                out.setdefault(f"{kind}_nice", []).append(niced[kind])
            out.setdefault("embedding", []).append(rates[-2][0])
            out.setdefault("e_beside", []).append(embedded["beside"])
            out.setdefault("query_ms", []).append(embedded["query_ms"])
            out.setdefault("e_alone", []).append(embed_for(url, ALONE_SECONDS))
    for var in PRIORITY_VARS:
        os.environ.pop(var, None)
    return {k: statistics.median(v) for k, v in out.items()}


def load_cells(r: dict, kind: str) -> str:
    if kind not in r:
        return "| - | - | - "
    return (f"| {r[kind]:.0f} (nice {r[kind + '_nice']:.0f}) | {r[kind] / r['alone']:.2f}x "
            f"| {r[kind + '_window']:.1f} s ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--settings", default=",".join(s.key for s in SETTINGS),
                   help="which settings to run, by key, comma-separated (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/neighbour-cpu.md")
    args = p.parse_args()
    keys = args.settings.split(",")
    if unknown := set(keys) - {s.key for s in SETTINGS}:
        p.error(f"unknown settings {sorted(unknown)}: choose from "
                f"{', '.join(s.key for s in SETTINGS)}")
    load_before = os.getloadavg()
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-neighbour-"))
    a = build_model(work / "model-a", "llama", num_layers=8, hidden_size=256, seed=1)
    b = build_model(work / "model-b", "qwen3", num_layers=24, hidden_size=1024, seed=2)
    e = build_encoder(work / "e", "bert", hidden_size=256, num_layers=4, max_positions=512)
    rows = []
    for setting in (s for s in SETTINGS if s.key in keys):
        r = measure(work, a, b, e, setting, args.runs)
        rows.append((setting.label, r))
        print(setting.label, {k: round(v, 2) for k, v in r.items()}, flush=True)
    load_after = os.getloadavg()
    commit = git_commit()
    lines = [
        "# A chat model's decode beside a loading model and an embedding batch (CPU)", "",
        f"Machine: {platform.machine()} {platform.system()}, MLX CPU backend, "
        f"{os.cpu_count()} cores (load average 1/5/15 min "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} before the run, "
        f"{'/'.join(f'{x:.1f}' for x in load_after)} after). Commit {commit}. "
        f"`python -m bench.neighbour --runs {args.runs} --settings {args.settings}`: "
        f"{time.monotonic() - t0:.0f} s.", "",
        "A: random llama, 8 layers, hidden 256, 8 streams of 32-token greedy completions. "
        "B: random qwen3, 24 layers, hidden 1024 (1.2 GB float32), preloaded (POST "
        "/cluster/models/b/load) or loaded for a request (a completion naming b). E: random "
        "BERT, 4 layers, hidden 256, batches of 64 inputs of 100 tokens; a query is one input. "
        f"Medians of {args.runs} rounds; one `serve` per setting, one after the other. The "
        "nice value is the one B's loading thread read (/cluster/status).", "",
        "| setting | A alone tok/s | while B preloads | ratio | load window "
        "| while B loads for a request | ratio | load window |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {label} | {r['alone']:.0f} {load_cells(r, 'preload')}{load_cells(r, 'requested')}|"
          for label, r in rows), "",
        "| setting | A alone tok/s | while E embeds | ratio | E inputs/s beside A "
        "| E query beside A | E inputs/s, A idle |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {label} | {r['alone']:.0f} | {r['embedding']:.0f} | "
          f"{r['embedding'] / r['alone']:.2f}x | {r['e_beside']:.0f} | {r['query_ms']:.0f} ms "
          f"| {r['e_alone']:.0f} |" for label, r in rows), ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
