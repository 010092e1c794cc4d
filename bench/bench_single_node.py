#!/usr/bin/env python3
"""Single-node benchmark: our server (HTTP gateway -> gRPC -> node batcher) against mlx-lm,
on the same model, in the same run, with ratios.

Measures, each as a median of --repeats timed runs after a warm-up:

1. batch-1 decode tok/s: one streaming /v1/completions request (token-id prompt, ignore_eos,
   greedy), rate from the first to the last streamed token, against mlx-lm `generate_step`
   timed the same way (first to last yielded token).
2. aggregate tok/s with 8 and 32 concurrent streams: completion tokens / wall time from the
   first request sent to the last stream finished (prefill included), against mlx-lm
   `BatchGenerator` given the same prompts and max_tokens (all inserted at once).
3. TTFT at batch 1 for a short and a ~512-token prompt: request sent -> first streamed token,
   against mlx-lm `generate_step` call -> first token (prefill + first sample).

Fairness: the server runs alone (started with `python -m omlx_cluster serve`, stopped
before the reference runs); mlx-lm runs in a child process with exactly the node's environment
(`omlx_shared.blas.blas_env`: same LD_PRELOAD/OPENBLAS_NUM_THREADS, so the same BLAS)
and the node's compute dtype (float32 and dequantized on a CPU, the model's own dtype on a GPU).

    python bench/bench_single_node.py                      # the default model (SmolLM2-135M)
    python bench/bench_single_node.py --random-llama-1b    # random TinyLlama-shaped 1.1B, bf16

Results: bench/results/single_node_<tag>.json and .md (tag: cpu, h200, gpu, or --tag).
"""

from __future__ import annotations

import argparse
import asyncio
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
RANDOM_LLAMAS = {"1b": ("random-llama-1.1b", "TinyLlama-1.1B", TINYLLAMA),
                 "8b": ("random-llama-8b", "Llama-3-8B (vocab 32000)", LLAMA8B)}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="model folder or store name (default: the default model)")
    ap.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS), default=None,
                    help="build and use a random-weight llama in bf16: 1b (TinyLlama shape) or "
                         "8b (Llama-3-8B layers)")
    ap.add_argument("--random-llama-1b", dest="random_llama", action="store_const", const="1b",
                    help="same as --random-llama 1b")
    ap.add_argument("--random-layers", type=int, default=None,
                    help="override the random llama's layer count (quick dry runs)")


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
    """A random-weight llama of RANDOM_LLAMAS[size]'s shape in bf16, as an mlx-lm folder with a
    32000-token word-level tokenizer (every id decodes to text, so streamed tokens are never
    held back)."""
    shape = RANDOM_LLAMAS[size][2]
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
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if layers:
        config["num_hidden_layers"] = layers
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.bfloat16)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))


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
    """mlx-lm on the same model, prompts and max_tokens; runs in the node's environment."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load_model

    deadline = time.monotonic() + spec["timeout"]
    model, _ = load_model(Path(spec["model"]))
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
        n = len(times)
        rate = (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None
        return {"ttft": times[0] - t0, "decode_tps": rate, "tokens": n}

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
                "ttft_mean": statistics.mean(ttfts), "steady_tps": steady_rate(list(times.values()))}

    return run_workloads(spec, single, batch) | {
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
    """The same schedule on both sides: warm-up, then `repeats` timed runs of each workload.
    `single(prompt, max_tokens)` and `batch(prompts, max_tokens)` return dicts."""
    p = spec["prompts"]
    reps, warm = spec["repeats"], spec["warmup_tokens"]
    out: dict = {}
    log = spec.get("log", True)

    def note(msg: str) -> None:
        if log:
            print(f"  [{spec['side']}] {msg}", file=sys.stderr, flush=True)

    note("warm-up")
    single(p["decode"][0], min(warm, spec["decode_tokens"]))
    single(p["ttft_short"][0], spec["ttft_tokens"])
    single(p["ttft_long"][0], spec["ttft_tokens"])
    runs = [single(p["decode"][i + 1], spec["decode_tokens"]) for i in range(reps)]
    out["decode_b1"] = {"runs": runs, "median_tps": median([r["decode_tps"] for r in runs]),
                        "median_ttft": median([r["ttft"] for r in runs])}
    note(f"decode b1: {out['decode_b1']['median_tps']:.2f} tok/s")
    for name in ("ttft_short", "ttft_long"):
        runs = [single(p[name][i + 1], spec["ttft_tokens"]) for i in range(reps)]
        out[name] = {"runs": runs, "median_s": median([r["ttft"] for r in runs]),
                     "prompt_tokens": len(p[name][0])}
        note(f"{name}: {out[name]['median_s'] * 1000:.1f} ms")
    for c in spec["concurrency"]:
        sets = p[f"conc_{c}"]
        batch(sets[0], min(warm, spec["conc_tokens"]))
        runs = [batch(sets[i + 1], spec["conc_tokens"]) for i in range(reps)]
        out[f"agg_{c}"] = {"runs": runs, "median_tps": median([r["agg_tps"] for r in runs]),
                           "median_ttft_mean": median([r["ttft_mean"] for r in runs]),
                           "median_steady_tps": median([r["steady_tps"] for r in runs])}
        note(f"aggregate x{c}: {out[f'agg_{c}']['median_tps']:.1f} tok/s")
    return out


# ---- our server ---------------------------------------------------------------------------------


class Server:
    def __init__(self, model: Path, log_path: Path, extra: list[str]):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "omlx_cluster", "serve", "--model", str(model),
               "--model-id", "bench", "--port", str(self.port), "--log-level", "warning", *extra]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

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


def measure_server(spec: dict, model: Path, work: Path, extra: list[str]) -> dict:
    import httpx

    server = Server(model, work / "server.log", extra)
    try:
        ready_s = server.wait_ready(SERVER_START_TIMEOUT)
        print(f"  [ours] server ready in {ready_s:.1f}s", file=sys.stderr, flush=True)
        loop = asyncio.new_event_loop()
        client = httpx.AsyncClient(timeout=httpx.Timeout(spec["timeout"]),
                                   limits=httpx.Limits(max_connections=256))
        deadline = time.monotonic() + spec["timeout"]

        def run(coro):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the server side ran past its time limit")
            return loop.run_until_complete(asyncio.wait_for(coro, left))

        def single(prompt, max_tokens):
            r = run(stream_one(client, server.base, prompt, max_tokens))
            return {k: r[k] for k in ("ttft", "decode_tps", "tokens", "events")}

        def batch(prompts, max_tokens):
            return run(stream_batch(client, server.base, prompts, max_tokens))

        try:
            out = run_workloads(spec, single, batch)
        finally:
            loop.run_until_complete(client.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        out["server_ready_s"] = ready_s
        return out
    except Exception:
        print(f"server log tail:\n{server.tail()}", file=sys.stderr)
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
    p = {"decode": [prompt(args.prompt_tokens) for _ in range(n)],
         "ttft_short": [prompt(args.short_prompt) for _ in range(n)],
         "ttft_long": [prompt(args.long_prompt) for _ in range(n)]}
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


def summarize(ours: dict, ref: dict, conc: list[int]) -> list[dict]:
    rows = [{"metric": "decode tok/s, batch 1", "ours": ours["decode_b1"]["median_tps"],
             "mlx_lm": ref["decode_b1"]["median_tps"], "unit": "tok/s", "goal": 0.95}]
    for c in conc:
        rows.append({"metric": f"aggregate tok/s, {c} streams", "ours": ours[f"agg_{c}"]["median_tps"],
                     "mlx_lm": ref[f"agg_{c}"]["median_tps"], "unit": "tok/s", "goal": 0.9})
    for c in conc:
        rows.append({"metric": f"decode-phase tok/s, {c} streams (all decoding)",
                     "ours": ours[f"agg_{c}"]["median_steady_tps"],
                     "mlx_lm": ref[f"agg_{c}"]["median_steady_tps"], "unit": "tok/s", "goal": None})
        rows.append({"metric": f"mean TTFT, {c} streams at once",
                     "ours": ours[f"agg_{c}"]["median_ttft_mean"] * 1000,
                     "mlx_lm": ref[f"agg_{c}"]["median_ttft_mean"] * 1000, "unit": "ms",
                     "goal": None})
    for name, label in (("ttft_short", "short"), ("ttft_long", "long")):
        rows.append({"metric": f"TTFT, {label} prompt ({ours[name]['prompt_tokens']} tok)",
                     "ours": ours[name]["median_s"] * 1000, "mlx_lm": ref[name]["median_s"] * 1000,
                     "unit": "ms", "goal": None})
    for r in rows:
        # speed ratio: >1 means ours is faster (for TTFT: mlx-lm time / our time)
        r["ratio"] = ratio(r["ours"], r["mlx_lm"]) if r["unit"] == "tok/s" else \
            ratio(r["mlx_lm"], r["ours"])
    return rows


def fmt(x, unit="") -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def markdown(result: dict) -> str:
    m, s, ref = result["machine"], result["settings"], result["mlx_lm"]
    dev = m["gpu"] or m["cpu"]
    lines = [
        f"# Single-node benchmark: omlx-cluster vs mlx-lm ({result['tag']})",
        "",
        f"- machine: {dev} ({m['cpu_count']} CPU cores: {m['cpu']}); MLX device `{ref['device']}`",
        f"- mlx {ref['mlx_version']}, mlx-lm {ref['mlx_lm_version']}, python {m['python']}, "
        f"commit {m['git_commit']}",
        f"- model: {result['model']['name']} ({result['model']['desc']}), compute dtype "
        f"{ref['dtype']} on both sides",
        f"- BLAS (node and reference alike): {result['blas']['used']}",
        f"- settings: prompt {s['prompt_tokens']} tok, decode max_tokens {s['decode_tokens']}, "
        f"concurrent max_tokens {s['conc_tokens']}, TTFT prompts {s['short_prompt']}/"
        f"{s['long_prompt']} tok, medians of {s['repeats']} runs after a warm-up; server flags "
        f"`{' '.join(s['server_args']) or '(defaults)'}`",
        "",
        "| metric | omlx-cluster | mlx-lm | speed ratio (ours/mlx-lm) | goal |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        goal = f">= {r['goal']}" if r["goal"] else ""
        lines.append(f"| {r['metric']} | {fmt(r['ours'])} {r['unit']} | {fmt(r['mlx_lm'])} "
                     f"{r['unit']} | {fmt(r['ratio'])} | {goal} |")
    lines += ["", "Speed ratio > 1 means omlx-cluster is faster; for TTFT it is mlx-lm time / our "
              "time. Ours is measured end to end through HTTP streaming (gateway -> gRPC -> node); "
              "mlx-lm in-process (`generate_step`, `BatchGenerator`).", ""]
    if result["blas"].get("probe"):
        lines.append("BLAS probe (fp32 GFLOP/s): " + "; ".join(
            f"{k}: {v}" for k, v in result["blas"]["probe"].items()))
        lines.append("")
    return "\n".join(lines)


def print_table(result: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(result))
        return
    t = Table(title=f"omlx-cluster vs mlx-lm, single node ({result['tag']}: "
                    f"{result['machine']['gpu'] or result['machine']['cpu']})")
    for col in ("metric", "omlx-cluster", "mlx-lm", "speed ratio", "goal"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in result["rows"]:
        ok = r["goal"] is None or (r["ratio"] or 0) >= r["goal"]
        color = "green" if ok else "red"
        t.add_row(r["metric"], f"{fmt(r['ours'])} {r['unit']}", f"{fmt(r['mlx_lm'])} {r['unit']}",
                  f"[{color}]{fmt(r['ratio'])}[/{color}]", f">= {r['goal']}" if r["goal"] else "")
    Console().print(t)
    Console().print(f"BLAS: {result['blas']['used']}")


def select_model(args, work: Path, base_env: dict) -> tuple[Path, str, str, dict]:
    """The model a bench runs on: the random TinyLlama-shaped llama (built once under `work`)
    with --random-llama-1b, else a stored or given folder. Returns (folder, name, description,
    config)."""
    if args.random_llama:
        base, like, shape = RANDOM_LLAMAS[args.random_llama]
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
                f"{layers} layers, bf16 on disk")
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
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--tag", help="results file tag (default: h200/gpu/cpu from the machine)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128, help="max_tokens, batch-1 decode")
    ap.add_argument("--conc-tokens", type=int, default=64, help="max_tokens per concurrent stream")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length for decode runs")
    ap.add_argument("--short-prompt", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=512)
    ap.add_argument("--ttft-tokens", type=int, default=4, help="max_tokens of TTFT requests")
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="max_tokens of warm-up runs (on a GPU use the full length: new shapes "
                         "JIT-compile)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra flag for `serve` (repeatable), e.g. --server-arg=--max-batch=64")
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
        elif args._child.startswith("probe"):
            res = blas_probe()
        else:
            res = reference(payload)
        Path(args._result).write_text(json.dumps(res))
        return 0

    from omlx_shared.blas import blas_env

    t_start = time.monotonic()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="omlx-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    tag = args.tag or ("h200" if "H200" in machine["gpu"] else "gpu" if machine["gpu"] else "cpu")
    node_env = blas_env()  # exactly what a node agent gives its shard worker
    base_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",
                                                                 "OPENBLAS_NUM_THREADS")}

    model, model_name, desc, config = select_model(args, work, base_env)
    vocab = int(config["vocab_size"])

    spec = {"model": str(model), "prompts": make_prompts(vocab, args), "repeats": args.repeats,
            "decode_tokens": args.decode_tokens, "conc_tokens": args.conc_tokens,
            "concurrency": args.concurrency, "ttft_tokens": args.ttft_tokens,
            "warmup_tokens": args.warmup_tokens, "timeout": args.timeout}
    blas = {"used": blas_of(node_env), "node_env": {k: node_env.get(k) for k in
                                                    ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")},
            "openblas_installed": Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
            .exists()}
    if not machine["gpu"] and not args.skip_blas_probe:
        probe = {"with_node_env": child("probe_node", {}, node_env, 120, work)}
        if node_env.get("LD_PRELOAD"):
            probe["mlx_wheel_blas"] = child("probe_plain", {}, base_env, 120, work)
        blas["probe"] = {f"{env}.{k}": v for env, d in probe.items() for k, v in d.items()}

    print(f"model {model} | BLAS: {blas['used']} | work dir {work}", file=sys.stderr, flush=True)
    print("== omlx-cluster server ==", file=sys.stderr, flush=True)
    ours = measure_server(spec | {"side": "ours"}, model, work, args.server_arg)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"single_node_{tag}.partial.json").write_text(json.dumps(
        {"machine": machine, "model": str(model), "blas": blas, "ours": ours}, indent=1))
    print("== mlx-lm reference (node environment) ==", file=sys.stderr, flush=True)
    ref = child("reference", spec | {"side": "mlx-lm"}, node_env, args.timeout + 300, work)

    rows = summarize(ours, ref, args.concurrency)
    settings = {k: getattr(args, k) for k in ("repeats", "decode_tokens", "conc_tokens",
                                              "concurrency", "prompt_tokens", "short_prompt",
                                              "long_prompt", "ttft_tokens", "warmup_tokens")}
    settings["server_args"] = args.server_arg
    result = {"tag": tag, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine,
              "model": {"name": model_name, "desc": desc, "path": str(model)},
              "settings": settings, "blas": blas, "rows": rows, "ours": ours,
              "mlx_lm": ref, "bench_seconds": round(time.monotonic() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"single_node_{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"single_node_{tag}.md").write_text(markdown(result))
    (args.out / f"single_node_{tag}.partial.json").unlink(missing_ok=True)
    print_table(result)
    print(f"wrote {args.out}/single_node_{tag}.json and .md "
          f"({result['bench_seconds']:.0f}s)", file=sys.stderr)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
