"""What the benchmarks share: the machine a result names, the models they run (random-weight
llamas, stored or tiny test models), our server and mlx_lm.server as processes, streaming
clients over HTTP, the workload schedule every side of a comparison runs, raw mlx-lm in
process, and an agent-ready copy of a model.

Run the benchmarks as modules from the repository root (`python -m bench.single_node`); the
processes they start get the repository on PYTHONPATH (`with_repo_path`)."""

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
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def with_repo_path(env: dict) -> dict:
    """`env` with the repository first on PYTHONPATH, so a child can run `-m bench.X` and
    import the project from this checkout."""
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))


def run_child(module: str, mode: str, payload: dict, env: dict, timeout: float,
              work: Path) -> dict:
    """Runs `python -m module --_child mode` on `payload` (a JSON file in `work`) in `env`, a
    process of its own (its own BLAS environment, its memory freed after); returns the JSON
    it wrote."""
    spec_file = work / f"{mode}.in.json"
    out_file = work / f"{mode}.out.json"
    spec_file.write_text(json.dumps(payload))
    cmd = [sys.executable, "-m", module, "--_child", mode, "--_spec", str(spec_file),
           "--_result", str(out_file)]
    proc = subprocess.run(cmd, env=with_repo_path(env), timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} child of {module} failed with code {proc.returncode}")
    return json.loads(out_file.read_text())


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
    """The model, where results go, and the workloads' shapes: what bench.paired shares."""
    add_model_args(ap)
    ap.add_argument("--out", type=Path, default=RESULTS)
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


def git_commit() -> str:
    """The checkout's short commit, for a results file; "" outside git."""
    return sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])


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
            "git_commit": git_commit() or None}


def machine_tag(machine: dict) -> str:
    """A results file's default tag: h200, gpu or cpu."""
    return "h200" if "H200" in machine["gpu"] else "gpu" if machine["gpu"] else "cpu"


def plain_env() -> dict:
    """This process's environment without the node's BLAS settings (what blas_env adds)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}


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


def scratch_model(work: Path, random_llama: str | None, context: int, **tiny) -> tuple[Path, int]:
    """A scratch model under `work`: a random llama of that RANDOM_LLAMAS shape, else a tiny
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
        env = with_repo_path(dict(os.environ if env is None else env))
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


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, unit="") -> str:
    if x is None:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


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
            run_child("bench.common", "build", {"dest": str(model), "layers": args.random_layers,
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


def agent_tools() -> list[dict]:
    """12 tools shaped like Claude Code's (name, description, JSON schema input)."""
    names = ["Bash", "Edit", "Glob", "Grep", "LS", "MultiEdit", "NotebookEdit", "Read",
             "TodoWrite", "WebFetch", "WebSearch", "Write"]
    return [{"name": n, "description": f"{n}: " + "performs the operation it names. " * 20,
             "input_schema": {"type": "object", "required": ["path"],
                              "properties": {"path": {"type": "string", "description": "path"},
                                             "content": {"type": "string"},
                                             "limit": {"type": "integer", "minimum": 1}}}}
            for n in names]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def agent_ready(model: Path, tokens: int, work: Path) -> Path:
    """A copy of `model` (weights linked, not copied) that an agent can use: a context of
    `tokens`, Qwen's tool-calling chat template (tests/tiny_models.py: `<tool_call>` JSON
    markup, so the tools Claude Code sends are rendered and parsed), and a byte-level BPE
    tokenizer where the model's vocabulary cannot spell JSON (the random llamas' word-level
    one). Timing, not text, is what counts here."""
    from tests.tiny_models import QWEN_TEMPLATE, build_tokenizer

    config = json.loads((model / "config.json").read_text())
    word_level = json.loads((model / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    dest = work / f"{model.name}-agent{tokens}"
    if not dest.exists():
        dest.mkdir(parents=True)
        for f in model.iterdir():
            if f.name != "config.json" and not (word_level and f.name in TOKENIZER_FILES):
                (dest / f.name).symlink_to(f.resolve())
        if word_level:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            corpus = [f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))]
            build_tokenizer(dest, vocab_size=int(config["vocab_size"]), corpus=corpus)
            config["eos_token_id"] = 2  # <|im_end|>, the template's end of turn
        # The template as its own file (transformers reads it before tokenizer_config's).
        tok_config = dest / "tokenizer_config.json"
        settings = json.loads(tok_config.read_text())
        settings.pop("chat_template", None)
        tok_config.unlink()  # links into the model's folder: write copies
        tok_config.write_text(json.dumps(settings, indent=1))
        (dest / "chat_template.jinja").unlink(missing_ok=True)
        (dest / "chat_template.jinja").write_text(QWEN_TEMPLATE)
        config["max_position_embeddings"] = max(tokens, int(config.get(
            "max_position_embeddings") or 0))
        (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


RESETS_RETRIED = 3


async def sse_lines(client, url: str, body: dict, headers: dict | None = None):
    """(arrival time, event name or None, parsed data) for each SSE event of a POST. A request
    whose connection is reset before any answer is sent again (at most RESETS_RETRIED times):
    mlx_lm.server's ThreadingHTTPServer listens with a backlog of 5, and of 16 sessions'
    connections opened at once the kernel resets some before the server reads them. The time
    the retry takes counts, as it would for that server's clients."""
    import httpx

    async with contextlib.AsyncExitStack() as stack:
        for attempt in range(RESETS_RETRIED + 1):
            try:
                r = await stack.enter_async_context(
                    client.stream("POST", url, json=body, headers=headers or {}))
                break
            except (httpx.ReadError, httpx.RemoteProtocolError):
                if attempt == RESETS_RETRIED:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if line[6:] == "[DONE]":
                    return
                yield time.perf_counter(), event, json.loads(line[6:])
                event = None


def main() -> int:
    """The one child mode of this module: build a random llama (select_model's)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--_child", choices=["build"], required=True)
    ap.add_argument("--_spec", required=True)
    ap.add_argument("--_result", required=True)
    args = ap.parse_args()
    payload = json.loads(Path(args._spec).read_text())
    build_random_llama(Path(payload["dest"]), payload.get("layers"), payload.get("size", "1b"))
    Path(args._result).write_text(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
