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

    python bench/bench_single_node.py                        # CPU: small float32 random llama
    python bench/bench_single_node.py --random-llama 1b      # GPU: TinyLlama-shaped 1.1B, bf16
    python bench/bench_single_node.py --random-llama 8b      # GPU: Llama-3-8B layers, bf16
    python bench/bench_single_node.py --model default        # the default model (SmolLM2-135M)

Results: bench/results/single_node_<tag>.json and .md (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SERVER_START_TIMEOUT = 300.0
TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, intermediate_size=5632, vocab_size=32000)
# Llama-3-8B's layers with TinyLlama's vocabulary (7.2B parameters, 14.5 GB in bf16): a model
# whose decode step is device work, not host overhead, on an H200.
LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=32000)
# A llama for a few-minute run on a 2-core CPU: narrow and shallow, so an 8192-token prefill
# (its attention grows with the square of the length, and MLX's CPU attention is slow) takes
# seconds, with a wide MLP and the full vocabulary, so a decode step is still model work.
SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=4096, vocab_size=32000)
# name: (folder, what it is shaped like, shape, dtype on disk)
RANDOM_LLAMAS = {"1b": ("random-llama-1.1b", "TinyLlama-1.1B", TINYLLAMA, "bfloat16"),
                 "8b": ("random-llama-8b", "Llama-3-8B (vocab 32000)", LLAMA8B, "bfloat16"),
                 "small": ("random-llama-small", "a small llama", SMALL, "float32")}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="model folder or store name ('default': the default model)")
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS), default=None,
                    help="build and use a random-weight llama: 1b (TinyLlama shape, bf16), 8b "
                         "(Llama-3-8B layers, bf16) or small (float32, for a CPU)")
    ap.add_argument("--random-llama-1b", dest="random_llama", action="store_const", const="1b",
                    help="same as --random-llama 1b")
    ap.add_argument("--random-layers", type=int, default=None,
                    help="override the random llama's layer count (quick dry runs)")


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The model, where results go, and the workloads' shapes: what bench_paired shares."""
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu from the machine)")
    ap.add_argument("--machine-note", default="",
                    help="how to describe the machine in the results (default: its CPU/GPU)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="max_tokens, batch-1 decode")
    ap.add_argument("--conc-tokens", type=int, default=64, help="max_tokens per concurrent stream")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for decode runs")
    ap.add_argument("--ttft-prompts", type=int, nargs="*", default=[2048, 8192],
                    help="prompt lengths of the batch-1 TTFT runs")
    ap.add_argument("--ttft-tokens", type=int, default=4, help="max_tokens of TTFT requests")
    ap.add_argument("--client-procs", type=int, default=4,
                    help="load-client processes the streams of a run are split over")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for `serve` (repeatable), e.g. --server-arg=--max-batch=64")


# ---- helpers ------------------------------------------------------------------------------------


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd: list[str], timeout: float = 20.0) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    gpu = sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
              "--format=csv,noheader"]) if shutil.which("nvidia-smi") else ""
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "platform": platform.platform(),
            "git_commit": sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]) or None}


def machine_tag(machine: dict) -> str:
    """A results file's default tag: h200, gpu or cpu."""
    return "h200" if "H200" in machine["gpu"] else "gpu" if machine["gpu"] else "cpu"


def plain_env() -> dict:
    """This process's environment without the node's BLAS settings (what blas_env adds)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}


@contextlib.contextmanager
def node_worker(model: Path, work: Path) -> Iterator[str]:
    """A node (`omlx-cluster node --model`, its log in `work`) holding every layer of `model`,
    with the BLAS a node's workers get: yields its worker's address, stops it on exit."""
    from omlx_shared.blas import blas_env

    ready_file = work / "node.ready.json"
    ready_file.unlink(missing_ok=True)
    env = blas_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(work / "node.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "omlx_cluster", "node", "--port", "0",
                                 "--ready-file", str(ready_file), "--model", str(model),
                                 "--log-level", "warning"], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not ready_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((work / "node.log").read_text()[-3000:])
            time.sleep(0.1)
        yield json.loads(ready_file.read_text())["worker_address"]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def blas_of(env: dict) -> str:
    pre = env.get("LD_PRELOAD", "")
    if "openblas" in pre:
        return f"OpenBLAS ({pre}, OPENBLAS_NUM_THREADS={env.get('OPENBLAS_NUM_THREADS', 'unset')})"
    if pre:
        return f"preloaded {pre}"
    return "the MLX wheel's own (reference BLAS on CPU; cuBLAS on CUDA)"


def steady_rate(streams: list[list[float]]) -> float | None:
    """Tokens/s while every stream is decoding: from the last stream's first token to the first
    stream's last token (isolates decode steps from the prefill/admission schedule)."""
    streams = [t for t in streams if t]
    if not streams:
        return None
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    if end <= start:
        return None
    n = sum(1 for t in streams for x in t if start < x <= end)
    return n / (end - start)


# ---- internal child modes -----------------------------------------------------------------------


def build_random_llama(dest: Path, layers: int | None, size: str = "1b") -> None:
    """A random-weight llama of RANDOM_LLAMAS[size]'s shape and dtype (write_random_llama)."""
    _, _, shape, dtype = RANDOM_LLAMAS[size]
    # Room for the 8192-token TTFT prompt: a server refuses prompts past this context.
    write_random_llama(dest, shape, dtype, layers, 16384)


def write_random_llama(dest: Path, shape: dict, dtype: str, layers: int | None,
                       context: int) -> None:
    """A random-weight llama of `shape` in `dtype`, `context` tokens long, as an mlx-lm folder
    with a word-level tokenizer (every id decodes to text, so streamed tokens are never held
    back, and "t5 t77" encodes back to exactly [5, 77] for a server that takes text)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dest.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<unk>").save_pretrained(dest)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **shape,
        "rms_norm_eps": 1e-5, "max_position_embeddings": context, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": dtype,
    }
    if layers:
        config["num_hidden_layers"] = layers
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def diag_model(work: Path, random_llama: str | None, context: int, **tiny) -> tuple[Path, int]:
    """A diagnostic's model under `work`: a random llama of that RANDOM_LLAMAS shape, else a tiny
    test llama (`tiny`: tests.tiny_models.build_model's settings), holding `context` tokens.
    Returns (folder, the token ids its prompts may draw from: [10, vocab))."""
    model = work / "model"
    if random_llama:
        _, _, shape, dtype = RANDOM_LLAMAS[random_llama]
        write_random_llama(model, shape, dtype, None, context)
        return model, shape["vocab_size"] - 1
    from tests.tiny_models import build_model

    build_model(model, "llama", **{"num_layers": 2, **tiny},
                extra_config={"max_position_embeddings": context})
    return model, 300  # inside the tiny tokenizer's vocabulary


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


def raw_mlx_lm(model_path: Path, deadline: float) -> tuple:
    """(single, batch, info): run_workloads' two workloads on raw mlx-lm (`generate_step`,
    `BatchGenerator`) in this process, refusing to start one past `deadline` (monotonic), and
    what was run."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(model_path)
    on_cpu = mx.default_device() == mx.cpu
    if on_cpu:  # what omlx_node.stage does on a CPU: dequantize, compute in float32
        dequantize_model(model)
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    dtype = str(model.model.layers[0].input_layernorm.weight.dtype).removeprefix("mlx.core.")

    def check_time() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError("the reference ran past its time limit")

    def single(prompt: list[int], max_tokens: int) -> dict:
        check_time()
        times = []
        t0 = time.perf_counter()
        cache = make_prompt_cache(model)
        for _tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                     prompt_cache=cache):
            times.append(time.perf_counter())
        n = len(times)  # end to end, as the HTTP sides are measured
        return {"ttft": times[0] - t0, "decode_tps": n / (times[-1] - t0), "tokens": n}

    def batch(prompts: list[list[int]], max_tokens: int) -> dict:
        check_time()
        gen = BatchGenerator(model, max_tokens=max_tokens,
                             completion_batch_size=max(32, len(prompts)))
        t0 = time.perf_counter()
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        times: dict[int, list[float]] = {u: [] for u in uids}
        done, ntok = set(), 0
        while len(done) < len(uids):
            if time.monotonic() > deadline:
                raise TimeoutError("BatchGenerator ran past the time limit")
            responses = gen.next_generated()
            now = time.perf_counter()
            for r in responses:
                ntok += 1
                times[r.uid].append(now)
                if r.finish_reason is not None:
                    done.add(r.uid)
        wall = time.perf_counter() - t0
        gen.close()
        ttfts = [times[u][0] - t0 for u in uids]
        return {"agg_tps": ntok / wall, "wall": wall, "tokens": ntok,
                "ttft_mean": statistics.mean(ttfts)}

    return single, batch, {
        "mlx_version": mx.__version__, "mlx_lm_version": mlx_lm.__version__,
        "device": str(mx.default_device()), "dtype": dtype,
        "device_info": _device_info(mx),
    }


def _device_info(mx) -> dict:
    try:
        return {k: (v if isinstance(v, (int, float, str)) else str(v))
                for k, v in mx.device_info().items()}
    except Exception:  # older MLX, or a backend without it
        return {}


def run_workloads(spec: dict, single, batch) -> dict:
    """The same schedule on every side: warm-up, then `repeats` timed runs of each workload.
    `single(prompt, max_tokens)` and `batch(prompts, max_tokens)` return dicts."""
    p = spec["prompts"]
    reps, warm = spec["repeats"], spec["warmup_tokens"]
    out: dict = {}

    def note(msg: str) -> None:
        print(f"  [{spec['side']}] {msg}", file=sys.stderr, flush=True)

    note("warm-up")
    for _ in range(spec["warmup_runs"]):
        single(p["decode"][0], min(warm, spec["decode_tokens"]))
        for n in spec["ttft_prompts"]:
            single(p[f"ttft_{n}"][0], spec["ttft_tokens"])
    runs = [single(p["decode"][i + 1], spec["decode_tokens"]) for i in range(reps)]
    out["decode_b1"] = {"runs": runs, "median_tps": median([r["decode_tps"] for r in runs]),
                        "median_ttft": median([r["ttft"] for r in runs])}
    note(f"decode b1: {out['decode_b1']['median_tps'] or 0:.2f} tok/s")
    for n in spec["ttft_prompts"]:
        name = f"ttft_{n}"
        runs = [single(p[name][i + 1], spec["ttft_tokens"]) for i in range(reps)]
        out[name] = {"runs": runs, "median_s": median([r["ttft"] for r in runs]),
                     "prompt_tokens": n}
        note(f"TTFT at {n} prompt tokens: {out[name]['median_s'] * 1000:.1f} ms")
    for c in spec["concurrency"]:
        sets = p[f"conc_{c}"]
        for _ in range(spec["warmup_runs"]):
            batch(sets[0], min(warm, spec["conc_tokens"]))
        runs = [batch(sets[i + 1], spec["conc_tokens"]) for i in range(reps)]
        out[f"agg_{c}"] = {"runs": runs, "median_tps": median([r["agg_tps"] for r in runs]),
                           "median_ttft_mean": median([r["ttft_mean"] for r in runs])}
        note(f"aggregate x{c}: {out[f'agg_{c}']['median_tps']:.1f} tok/s")
    return out


# ---- the HTTP load client (child processes) -----------------------------------------------------


async def _client_stream(client, url: str, body: dict) -> dict:
    """One streamed completion: send time, first-text time, last-event time, token count. JSON
    is parsed only until the first text and for the usage chunk, to keep the client cheap. A
    connection the server drops before answering is made again (mlx_lm.server's listen
    backlog is 5: at 64 streams at once some connections are reset), its time counted."""
    import httpx

    t0 = time.monotonic()
    for attempt in range(5):
        try:
            return await _client_read(client, url, body, t0)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            if attempt == 4:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("unreachable")


async def _client_read(client, url: str, body: dict, t0: float) -> dict:
    ttft = last = None
    tokens = events = 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            data = line[6:]
            if data == "[DONE]":
                break
            if '"error"' in data:
                raise RuntimeError(f"stream error: {data[:500]}")
            if '"usage"' in data:
                obj = json.loads(data)
                if obj.get("usage") and not obj.get("choices"):
                    tokens = obj["usage"]["completion_tokens"]
                    continue
            if ttft is None:
                choices = json.loads(data)["choices"]
                if not (choices and choices[0].get("text")):
                    continue
                ttft = now - t0
            events += 1
            last = now
    return {"t0": t0, "ttft": ttft, "t_first": t0 + ttft if ttft is not None else None,
            "t_last": last, "end": time.monotonic(), "tokens": tokens, "events": events}


async def _client_main(spec: dict) -> list[dict]:
    import httpx

    n = len(spec["bodies"])
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec["timeout"]),
                                 limits=httpx.Limits(max_connections=n + 4)) as client:
        # A fresh process's first request pays for lazy imports and connection setup (~25 ms on
        # the 2-core VM, ~145 ms on the H200 host, for every server alike): done before the
        # clock starts, with one kept-alive connection per stream where the server keeps them,
        # as an agent's SDK client does.
        models = spec["url"].rsplit("/v1/", 1)[0] + "/v1/models"
        t = time.monotonic()
        await asyncio.gather(*(client.get(models) for _ in range(n)))
        warmup = time.monotonic() - t
        print("ready", flush=True)
        # The parent starts every client process at once, once all are up.
        await asyncio.to_thread(sys.stdin.readline)
        streams = await asyncio.gather(*(_client_stream(client, spec["url"], b)
                                         for b in spec["bodies"]))
        return [s | {"client_warmup_s": warmup} for s in streams]


def run_clients(url: str, bodies: list[dict], procs: int, work: Path, timeout: float
                ) -> list[dict]:
    """Streams `bodies` at once from `procs` client processes; every stream's timings."""
    procs = max(1, min(procs, len(bodies)))
    parts, outs, running = [bodies[i::procs] for i in range(procs)], [], []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for i, part in enumerate(parts):
        spec_file, out_file = work / f"client{i}.in.json", work / f"client{i}.out.json"
        spec_file.write_text(json.dumps({"url": url, "bodies": part, "timeout": timeout}))
        out_file.unlink(missing_ok=True)
        outs.append(out_file)
        running.append(subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_child", "client",
             "--_spec", str(spec_file), "--_result", str(out_file)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    try:
        for p in running:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a load client failed to start")
        for p in running:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in running:
            if p.wait(timeout) != 0:
                raise RuntimeError(f"a load client failed with code {p.returncode}")
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [s for f in outs for s in json.loads(f.read_text())]


def http_workloads(spec: dict, url: str, body, work: Path, procs: int):
    """`single` and `batch` (run_workloads) over HTTP; body(prompt, max_tokens) is one request's
    JSON."""
    def batch(prompts: list[list[int]], max_tokens: int, procs: int = procs) -> dict:
        streams = run_clients(url, [body(p, max_tokens) for p in prompts], procs, work,
                              spec["timeout"])
        t0, end = min(s["t0"] for s in streams), max(s["end"] for s in streams)
        ntok = sum(s["tokens"] for s in streams)
        return {"agg_tps": ntok / (end - t0), "wall": end - t0, "tokens": ntok,
                "ttft_mean": statistics.mean(s["ttft"] for s in streams)}

    def single(prompt: list[int], max_tokens: int) -> dict:
        # End to end: a server that writes its events in bursts (mlx_lm.server does, on a CPU)
        # would make a first-to-last-event rate meaningless.
        s = run_clients(url, [body(prompt, max_tokens)], 1, work, spec["timeout"])[0]
        return {"ttft": s["ttft"], "decode_tps": s["tokens"] / (s["end"] - s["t0"]),
                "tokens": s["tokens"], "events": s["events"],
                "client_warmup_s": s["client_warmup_s"]}

    return single, batch


# ---- the servers --------------------------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


class Server:
    """Our server (`python -m omlx_cluster serve`) in its own session, its log in a file."""

    def __init__(self, model: Path, log_path: Path, extra: list[str],
                 env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(self.command(model, extra), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def command(self, model: Path, extra: list[str]) -> list[str]:
        # A fresh SSD tier per start: blocks a previous run stored for the same seeded
        # prompts would otherwise turn its TTFT runs into cache hits.
        fresh = [] if "--paged-ssd-cache-dir" in " ".join(extra) else [
            "--paged-ssd-cache-dir", str(self.log_path.parent / f"kv-cache-{self.port}")]
        return [sys.executable, "-m", "omlx_cluster", "serve", "--model", str(model),
                "--model-id", "bench", "--port", str(self.port), "--log-level", "warning",
                *fresh, *extra]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {timeout:.0f}s:\n{self.tail()}")

    def pids(self) -> list[int]:
        """The server's process and all its descendants."""
        return process_tree(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the gateway and its node child
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class MlxLmServer(Server):
    """mlx-lm's own server, batching up to `decode_concurrency` streams."""

    def command(self, model: Path, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(model),
                "--port", str(self.port), "--log-level", "WARNING", *extra]


def proc_ticks(pid: int) -> tuple[str, int] | None:
    """(name, utime + stime in clock ticks) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    args = [a.decode(errors="replace") for a in cmdline if a]
    # The module or script a Python process runs names it better than "python".
    name = next((" ".join(args[i + 1:i + 3]) for i, a in enumerate(args[:-1]) if a == "-m"),
                " ".join(Path(a).name for a in args[:3]))
    return name, int(fields[11]) + int(fields[12])


def thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """(name, utime + stime in clock ticks) of each thread of a live process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (stat[stat.index("(") + 1:stat.rindex(")")],
                               int(fields[11]) + int(fields[12]))
    return out


def idle_cpu(server: Server, seconds: float) -> list[dict]:
    """Each server process's CPU (% of one core) over `seconds` with no request in flight."""
    hz = os.sysconf("SC_CLK_TCK")
    before = {pid: t for pid in server.pids() if (t := proc_ticks(pid))}
    time.sleep(seconds)
    rows = []
    for pid, (name, ticks) in before.items():
        after = proc_ticks(pid)
        if after is not None:
            rows.append({"pid": pid, "name": name,
                         "cpu_percent": 100.0 * (after[1] - ticks) / hz / seconds})
    return rows


async def completion_events(client, base: str, prompt: list[int], max_tokens: int):
    """Streams a greedy /v1/completions of token ids; yields (arrival time, event object)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            yield now, obj


async def stream_one(client, base: str, prompt: list[int], max_tokens: int) -> dict:
    """One in-process stream (the other benches' client); several tokens may share an event."""
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    async for now, obj in completion_events(client, base, prompt, max_tokens):
        if obj.get("usage"):
            usage = obj["usage"]
        elif obj["choices"] and obj["choices"][0].get("text"):
            times.append(now)
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    rate = (n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 and times[-1] > times[0] \
        else None
    return {"ttft": times[0] - t0 if times else None, "decode_tps": rate, "tokens": n,
            "events": len(times), "t0": t0, "end": end, "times": times}


async def stream_batch(client, base: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """All `prompts` streamed at once: aggregate rate (prefill included) and decode-phase rate."""
    t0 = time.perf_counter()
    res = await asyncio.gather(*(stream_one(client, base, pr, max_tokens) for pr in prompts))
    wall = max(r["end"] for r in res) - t0
    ntok = sum(r["tokens"] for r in res)
    return {"agg_tps": ntok / wall, "wall": wall, "tokens": ntok,
            "ttft_mean": statistics.mean(r["ttft"] for r in res),
            "steady_tps": steady_rate([r["times"] for r in res])}


def ours_body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


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


def make_prompts(vocab: int, args, seed: int = 1234) -> dict:
    rng = random.Random(seed)
    hi = vocab - 1
    lo = min(100, hi // 2)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    n = args.repeats + 1  # the first of each list is the warm-up's
    p = {"decode": [prompt(args.prompt_tokens) for _ in range(n)]}
    for t in args.ttft_prompts:
        p[f"ttft_{t}"] = [prompt(t) for _ in range(n)]
    for c in args.concurrency:
        p[f"conc_{c}"] = [[prompt(args.prompt_tokens) for _ in range(c)] for _ in range(n)]
    return p


def child(mode: str, payload: dict, env: dict, timeout: float, work: Path) -> dict:
    spec_file = work / f"{mode}.in.json"
    out_file = work / f"{mode}.out.json"
    spec_file.write_text(json.dumps(payload))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", mode,
           "--_spec", str(spec_file), "--_result", str(out_file)]
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} child failed with code {proc.returncode}")
    return json.loads(out_file.read_text())


def ratio(a, b):
    return a / b if a and b else None


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


def fmt(x, unit="") -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


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


def select_model(args, work: Path, base_env: dict) -> tuple[Path, str, str, dict]:
    """The model a bench runs on: a random llama of --random-llama's shape (built once under
    `work`), else a stored or given folder. Returns (folder, name, description,
    config)."""
    if args.random_llama:
        base, like, shape, dtype = RANDOM_LLAMAS[args.random_llama]
        suffix = f"-{args.random_layers}l" if args.random_layers else ""
        model = work / f"{base}{suffix}"
        if not (model / "config.json").exists():
            print(f"building the random llama in {model} ...", file=sys.stderr, flush=True)
            t = time.monotonic()
            child("build", {"dest": str(model), "layers": args.random_layers,
                            "size": args.random_llama}, base_env, 600, work)
            print(f"  built in {time.monotonic() - t:.1f}s", file=sys.stderr, flush=True)
        layers = args.random_layers or shape["num_hidden_layers"]
        model_name = base + (f" ({layers} layers)" if args.random_layers else "")
        desc = (f"random weights, {like} shape (hidden {shape['hidden_size']}, "
                f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} kv, "
                f"intermediate {shape['intermediate_size']}, vocab {shape['vocab_size']}), "
                f"{layers} layers, {dtype} on disk")
    else:
        from omlx_shared.model_spec import resolve_model

        model = resolve_model(args.model, progress=True)
        model_name, desc = model.name, "from the model store" if args.model is None else str(model)
    config = json.loads((model / "config.json").read_text())
    if not args.random_llama:
        desc += f"; {config['num_hidden_layers']} layers, hidden {config['hidden_size']}"
        if config.get("quantization"):
            desc += f", quantized on disk ({config['quantization'].get('bits')}-bit)"
    return model, model_name, desc, config


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
        if args._child == "build":
            build_random_llama(Path(payload["dest"]), payload.get("layers"),
                               payload.get("size", "1b"))
            res = {"ok": True}
        elif args._child == "client":
            res = asyncio.run(_client_main(payload))
        elif args._child.startswith("probe"):
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
        probe = {"with_node_env": child("probe_node", {}, node_env, 120, work)}
        if node_env.get("LD_PRELOAD"):
            probe["mlx_wheel_blas"] = child("probe_plain", {}, base_env, 120, work)
        blas["probe"] = {f"{env}.{k}": v for env, d in probe.items() for k, v in d.items()}

    print(f"model {model} | BLAS: {blas['used']} | work dir {work}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f"single_node_{tag}.partial.json"
    measure = {
        "ours": lambda first: measure_ours(spec | {"side": "ours"}, model, work,
                                           args.server_arg, args.client_procs,
                                           args.idle_seconds, extras=first),
        "mlx_server": lambda first: measure_mlx_server(spec | {"side": "mlx_lm.server"}, model,
                                                       work, node_env, args.client_procs),
        "raw": lambda first: child("reference", spec | {"side": "raw"}, node_env,
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
    (args.out / f"single_node_{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"single_node_{tag}.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    print_table(result)
    print(f"wrote {args.out}/single_node_{tag}.json and .md "
          f"({result['bench_seconds']:.0f}s)", file=sys.stderr)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
