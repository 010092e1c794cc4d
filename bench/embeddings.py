"""Embedding throughput: inputs/s at batch 1, 32 and 256 on the same inputs, ours against
mlx-embeddings run directly in process (the issue's goal: >= 0.9x at 256).

- mlx-embeddings: its model called as its README does, each batch padded to its longest input
  with an attention mask, `text_embeds` evaluated.
- ours, in process: omlx_node/encoders.py's Encoder.run (length buckets, padded passes), the
  code a node's worker runs.
- ours, served: `omlx-cluster serve` with the model beside a tiny chat model, token-id inputs
  POSTed to /v1/embeddings one request a batch (HTTP, the gateway, gRPC and the worker).
- ours, concurrent clients: the same inputs as one-input requests from CLIENTS clients at once,
  which the worker merges into shared passes (omlx_node/encoder_worker.py); against
  mlx-embeddings at batch 1 (what a server running each request alone could reach) and at
  batch CLIENTS.

The model is a random BERT (hidden 128, 2 layers, 512 positions) with the tests' tokenizer;
the inputs 256 texts of 2 to ~90 tokens (a small model: the machine these ran on is a shared
2-core CPU). Each figure is the median of --runs timed rounds
after a warm-up round.

    python -m bench.embeddings [--runs 3] [--out bench/results/embeddings-cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from omlx_node.encoders import Encoder  # noqa: E402
from omlx_shared.blas import blas_env  # noqa: E402
from tests.conftest import start_server  # noqa: E402
from tests.tiny_encoders import build_encoder  # noqa: E402
from tests.tiny_models import CORPUS, build_model  # noqa: E402

BATCHES = (1, 32, 256)
N_INPUTS = 256
CLIENTS = 32


def inputs(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    words = " ".join(CORPUS * 4).split()
    texts = [" ".join(words[i % 11: i % 11 + 2 + (i * 37) % 40]) for i in range(N_INPUTS)]
    return [tok(t)["input_ids"][:500] for t in texts]


def library(folder: Path):
    from mlx_embeddings.utils import load_model

    model = load_model(folder, path_to_repo=str(folder))

    def run(batch: list[list[int]]) -> None:
        width = max(len(x) for x in batch)
        ids = np.zeros((len(batch), width), dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.float32)
        for r, x in enumerate(batch):
            ids[r, :len(x)], mask[r, :len(x)] = x, 1
        mx.eval(model(mx.array(ids), attention_mask=mx.array(mask)).text_embeds)
    return run


def rate(run, data: list[list[int]], batch: int, runs: int) -> float:
    """Inputs a second over all of `data` in batches of `batch`: the median of `runs`."""
    chunks = [data[i:i + batch] for i in range(0, len(data), batch)]
    times = []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        for c in chunks:
            run(c)
        if r:  # the first round warms up
            times.append(time.perf_counter() - t0)
    return len(data) / statistics.median(times)


def concurrent_rate(post, data: list[list[int]], runs: int) -> float:
    """Inputs a second over all of `data` sent one input a request by CLIENTS clients at once,
    each with its own connection: the median of `runs` after a warm-up round."""
    from concurrent.futures import ThreadPoolExecutor

    shares = [data[c::CLIENTS] for c in range(CLIENTS)]
    times = []
    with ThreadPoolExecutor(CLIENTS) as pool:
        for r in range(runs + 1):
            t0 = time.perf_counter()
            list(pool.map(lambda share: [post(x) for x in share], shares))
            if r:
                times.append(time.perf_counter() - t0)
    return len(data) / statistics.median(times)


def main() -> int:
    env = blas_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
        # As a node's worker runs (omlx_shared/blas.py): OpenBLAS preloaded, or the in-process
        # figures would be several times slower than the served ones for that reason alone.
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/embeddings-cpu.md")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    folder = build_encoder(root / "bert", "bert", hidden_size=128, num_layers=2,
                           max_positions=512)
    data = inputs(folder)
    ref, ours = library(folder), Encoder(folder).run
    rows = []
    # Throughput, not priority (bench/neighbour.py measures that): the worker's passes at the
    # priority the in-process side runs at, not at nice 10 below this shared machine's work.
    os.environ["OMLX_ENCODE_NICE"] = "0"
    with start_server(build_model(root / "chat", "llama", num_layers=1),
                      "--model", f"emb={folder}", home=root / "home") as server:
        client = httpx.Client(timeout=600)  # one connection, as a client keeps it

        def served(batch: list[list[int]]) -> None:
            r = client.post(server.base_url + "/embeddings",
                            json={"model": "emb", "input": batch})
            r.raise_for_status()

        for b in BATCHES:
            lib, mine, http = (rate(f, data, b, args.runs) for f in (ref, ours, served))
            rows.append((b, lib, mine, http))
            print(f"batch {b}: mlx-embeddings {lib:.1f}/s, ours in process {mine:.1f}/s "
                  f"({mine / lib:.2f}x), served {http:.1f}/s ({http / lib:.2f}x)", flush=True)
        local = threading.local()

        def post_one(x: list[int]) -> None:
            if not hasattr(local, "client"):
                local.client = httpx.Client(timeout=600)
            local.client.post(server.base_url + "/embeddings",
                              json={"model": "emb", "input": [x]}).raise_for_status()

        together = concurrent_rate(post_one, data, args.runs)
        lib1, lib_c = rows[0][1], next(r[1] for r in rows if r[0] == CLIENTS)
        print(f"{CLIENTS} clients, one input a request: served {together:.1f}/s "
              f"({together / lib1:.2f}x mlx-embeddings at batch 1, "
              f"{together / lib_c:.2f}x at batch {CLIENTS})", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    lengths = [len(x) for x in data]
    lines = [
        "# Embedding throughput against mlx-embeddings (CPU)", "",
        f"Machine: {platform.machine()} {platform.system()}, MLX CPU backend with OpenBLAS "
        f"preloaded (as a worker runs), 2 cores shared "
        f"with other engineers' work (figures are noisy; load average "
        f"{os.getloadavg()[0]:.1f} at the end). Commit {commit}. "
        f"`python -m bench.embeddings --runs {args.runs}`.", "",
        f"A random BERT (hidden 128, 2 layers), {N_INPUTS} inputs of {min(lengths)} to "
        f"{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), the same for all three; "
        f"inputs/s, median of {args.runs} rounds after a warm-up.", "",
        "| batch | mlx-embeddings direct | ours in process | ratio | ours served (HTTP) | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {b} | {lib:.1f} | {mine:.1f} | {mine / lib:.2f}x | {http:.1f} | {http / lib:.2f}x |"
          for b, lib, mine, http in rows), "",
        f"{CLIENTS} clients at once, each POSTing its share of the same {N_INPUTS} inputs one "
        f"input a request: served {together:.1f}/s, {together / lib1:.2f}x mlx-embeddings "
        f"direct at batch 1 and {together / lib_c:.2f}x at batch {CLIENTS}; "
        f"{together / rows[0][3]:.2f}x ours served one request at a time (the worker merges "
        "the requests that queue while a pass runs into shared passes; what is left is each "
        "request's HTTP, gateway and gRPC work on these 2 cores).", "",
        "The served worker ran at nice 0 (OMLX_ENCODE_NICE=0), as the in-process "
        "sides do; as shipped it runs at nice 10, below a chat model's decode "
        "(neighbour-cpu.md).", "",
        "Ours sorts a request's inputs by length and pads each pass to its longest input; "
        "mlx-embeddings run directly pads a whole batch to its longest input. "
        "Served adds tokenizer-free HTTP (token-id input), the gateway, gRPC and the worker's "
        "queue.", ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
