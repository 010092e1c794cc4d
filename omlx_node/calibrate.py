"""Measure how fast this node streams weights, for the planner's NodeSpec.speed.

Decode is memory-bandwidth bound: every step multiplies one activation vector per sequence by
every weight matrix a stage holds, so the useful speed is weight bytes streamed per second
through matrix-vector products, not peak FLOPs. The planner wants it in GB/s:

    NodeSpec(name, memory_bytes, speed=measure_speed() / 1e9)

A step also pays each layer's fixed cost (its ops' dispatch, norms, attention), which does not
scale with the bytes a node holds (a tensor-parallel rank pays all of it on its share):
`measure_layer_ms` times it, the planner's NodeSpec.layer_ms.

MLX is imported inside the functions: the coordinator imports this package on machines that
have no MLX. `omlx-cluster join` measures once per machine (`node_calibration`) and reports
the results to the coordinator when it is admitted.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


class Stopwatch:
    """Seconds of this node's own work since it was made: what a calibration times.

    On a CPU, the lesser of the wall clock and this process's CPU seconds. The calibration is
    kept for every later join, so it must not read a shared machine's passing load as this
    node's speed: on the wall clock, time spent waiting for a core counts as the node's
    (bench/results/tensor-parallel-cpu.md). The wall clock where it is less: a BLAS that runs
    several threads (OPENBLAS_NUM_THREADS > 1) spends more CPU seconds than wall seconds. On a
    GPU, the wall clock (its work is not this process's CPU time)."""

    def __init__(self) -> None:
        import mlx.core as mx

        self._cpu = mx.default_device() == mx.cpu
        self._wall, self._own = time.perf_counter(), time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self._wall

    def seconds(self) -> float:
        wall = self.wall()
        return min(wall, time.process_time() - self._own) if self._cpu else wall


def measure_speed(
    seconds: float = 1.0, dim: int = 4096, matrices: int = 4, dtype: str | None = None
) -> float:
    """Weight bytes per second this node streams through (1, dim) x (dim, dim) matmuls.

    Each matrix is read as an nn.Linear reads its weight, `x @ w.T` (stored out x in): on a
    CPU, MLX streams that layout at a lower rate than `x @ w`, so measuring the other one
    predicted decode faster than the model ran. Square matrices, though a BLAS streams
    each shape at its own rate: the seven matrices of a llama layer came no closer to real
    models' decode (the numbers: bench/results/tensor-parallel-cpu.md). `matrices` distinct
    matrices (4 x 4096^2 fp16 = 128 MiB) so the working set exceeds the on-chip caches, as real
    weights do; one synchronising eval per pass over them, as a decode step has. dtype defaults
    to float16 on a GPU and float32 on a CPU (where MLX's half-precision kernels are slow and
    the node computes in float32 anyway). Runs for about `seconds`; the speed is the fastest
    pass's: one that another process's burst slowed (a page cache's writeback, a neighbour
    sharing the memory bus) is not the node's, and a mean over the passes let one such burst
    move the node's speed between two runs even on a quiet machine.
    """
    import mlx.core as mx

    if dtype is None:
        dt = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    else:
        dt = getattr(mx, dtype)
    scale = 1.0 / math.sqrt(dim)  # keeps activations O(1) through the chain of products
    key = mx.random.key(0)
    keys = mx.random.split(key, matrices + 1)
    weights = [(mx.random.normal((dim, dim), key=k) * scale).astype(dt) for k in keys[:matrices]]
    x = mx.random.normal((1, dim), key=keys[matrices]).astype(dt)
    mx.eval(weights, x)
    pass_bytes = sum(w.nbytes for w in weights)

    def one_pass() -> None:
        y = x
        for w in weights:
            y = y @ w.T
        mx.eval(y)

    one_pass()  # warm-up: kernel compilation and first-touch page faults are not bandwidth
    fastest = math.inf
    started = time.perf_counter()
    while True:  # bounded by the wall clock, each pass timed by the node's own work
        watch = Stopwatch()
        one_pass()
        fastest = min(fastest, watch.seconds())
        if time.perf_counter() - started >= seconds:
            break
    return pass_bytes / max(fastest, 1e-9)


def measure_layer_ms(seconds: float = 1.0, depths: tuple[int, int] = (2, 10)) -> float:
    """Milliseconds a decoder layer adds to a decode step beyond its weight reads: the slope of
    a batch-1 step's time over the depth of a tiny random llama (mlx-lm's own layers, hidden size
    64, so its weights read in microseconds), each step built, evaluated and its token sampled
    as the engine does. What is left is the dispatch of each layer's ~20 ops, its norms, rope
    and attention over a short context (a fraction of a millisecond a layer on a CPU core),
    which a tensor-parallel rank's share of the weights does not shrink. Runs for about
    `seconds`."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    def step_ms(layers: int, budget: float) -> float:
        model = llama.Model(llama.ModelArgs(
            model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
            rope_theta=10000.0, tie_word_embeddings=False))
        mx.eval(model.parameters())
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((1, 32), dtype=mx.int32), cache=cache))
        y = mx.zeros((1, 1), dtype=mx.int32)
        times: list[float] = []
        start = time.perf_counter()
        # At least 5 steps, the first a warm-up; at most 200 (a context of 232 tokens).
        while len(times) < 5 or (time.perf_counter() - start < budget and len(times) < 200):
            watch = Stopwatch()
            y = mx.argmax(model(y, cache=cache)[:, -1:, :], axis=-1)
            mx.eval(y)
            times.append(watch.seconds())
        return statistics.median(times[1:]) * 1e3

    shallow, deep = depths
    ms = [step_ms(d, seconds / 2) for d in depths]
    return max(0.0, (ms[1] - ms[0]) / (deep - shallow))


def row_costs(fn: Callable, width: int, dtype: str,
              rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
              repeats: int = 5, budget_seconds: float = 2.0) -> dict[int, float]:
    """Seconds one call of `fn` (a layer's MLP, say) takes on (r, 1, width) inputs for each r:
    how a decode step's cost grows with its rows on this device. Flat means weight-bandwidth
    bound (splitting a batch buys nothing), proportional means compute bound. Stops at the
    first row count that ends past `budget_seconds` (a big layer on a CPU): the curve's last
    segment stands for the rest.

    On a CPU the calls and the budget are timed in this process's CPU seconds (nothing else of
    it should run meanwhile): a thread at a low priority beside busy workers (a load's, where
    a worker calibrates) waits for the cores during and between its calls. On the wall clock
    that wait read as cost and ate the budget: beside busy processes at low priorities the
    curve ended after its first few row counts, each far dearer than its calls were (and
    speculation then went on for rows it could not afford), where CPU seconds gave the whole
    curve. A GPU's work is not this process's CPU time: there, the wall clock."""
    import mlx.core as mx

    dt = getattr(mx, dtype)
    clock = time.process_time if mx.default_device() == mx.cpu else time.perf_counter
    out: dict[int, float] = {}
    start = clock()
    for r in rows:
        if len(out) >= 2 and clock() - start > budget_seconds:
            break
        x = mx.random.normal((r, 1, width)).astype(dt)
        mx.eval(fn(x))  # warm-up: kernels are built per shape on some backends
        times = []
        for _ in range(repeats):
            t = clock()
            mx.eval(fn(x))
            times.append(clock() - t)
        # Never cheaper with more rows: a noisy sample must not invent a knee.
        out[r] = max(sorted(times)[len(times) // 2], *out.values(), 0.0)
    return out


def step_cost(costs: dict[int, float], rows: int) -> float:
    """A step's cost at `rows`, interpolated from a measured curve of at least two points
    (extrapolated along its last segment past its end)."""
    pts = sorted(costs.items())
    for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
        if rows <= r1:
            break
    return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)


# What the saved measurement was made with: a cache of another method is measured again
# (2: weights read as nn.Linear reads them, and each layer's fixed cost; 3: timed in the node's
# own work, `Stopwatch`, with the workers' BLAS; 4: the fastest pass's speed).
METHOD = 4


@dataclass(frozen=True)
class Calibration:
    """What `join` measures of its machine for the planner (NodeSpec.speed and layer_ms)."""
    speed_gbps: float = 0.0  # 0.0: not measured
    layer_ms: float = 0.0


def node_calibration(cache: Path, recalibrate: bool = False,
                     timeout: float = 120.0) -> Calibration:
    """This machine's weight-streaming speed (GB/s) and a layer's fixed cost (ms) for the
    planner: measured once in a child process (a node agent never runs MLX itself) and kept in
    `cache` for the next join; zeros (uncalibrated) if the measurement fails, with a warning
    that says why.

    The child runs with the BLAS a shard worker runs with (`blas_env`): measured with the MLX
    wheel's own BLAS, a node read slower than its workers, which preload OpenBLAS, decode
    (bench/results/tensor-parallel-cpu.md). A cache measured with another BLAS (OpenBLAS
    installed since, OMLX_BLAS changed) is measured again."""
    from omlx_shared.blas import blas_env
    from omlx_shared.hardware import chip

    here, env = chip(), blas_env()
    blas = env.get("LD_PRELOAD", "")
    if not recalibrate:
        try:
            saved = json.loads(cache.read_text())
            if (saved.get("chip") == here and saved.get("method") == METHOD
                    and saved.get("blas") == blas and saved.get("speed_gbps", 0) > 0):
                return Calibration(float(saved["speed_gbps"]), float(saved["layer_ms"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:
        out = subprocess.run([sys.executable, "-m", "omlx_node.calibrate"], capture_output=True,
                             text=True, timeout=timeout, check=True, env=env)
        measured = Calibration(**json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, TypeError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("could not measure this node's speed (the planner will treat it as "
                    "average): %s", detail.strip()[-500:])
        return Calibration()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"chip": here, "method": METHOD, "blas": blas,
                                     **asdict(measured)}))
    except OSError as e:
        log.warning("could not save the speed to %s: %s", cache, e)
    return measured


if __name__ == "__main__":
    print(json.dumps(asdict(Calibration(measure_speed() / 1e9, measure_layer_ms()))))
