"""Prometheus metrics of a shard worker, one stage of one plan (`omlx_node_<name>`).

Every stage exports them, each series with the stage's identity (IDENTITY_LABELS), added at
export: which node, model, plan, stage (its rank) and layers. The engine's series (requests,
tokens, latencies, a request's phases) move on the head, stage 0; the `omlx_node_stage_*`
series, KV and memory use move on every stage, so the stages of a pipeline can be compared.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from omlx_shared.hardware import memory_pressure, process_footprint
from omlx_shared.prometheus import LATENCY_BUCKETS, labelled

IDENTITY_LABELS = ("node", "model", "plan", "stage", "layers")
# Some decode steps are timed, synchronously: timing all of them would put Python between
# every two device steps, which the engine and the pipeline are built to avoid. In a pipeline
# every stage times the same steps, one in PROFILE_EVERY: a timed step drains the stages before
# it, so each one's wait for its input is the previous stages' own time, which the rebalancer
# tells compute from (timed at different steps, a stage next to a slow one looked as slow). A
# single stage times one step a PROFILE_SECONDS: on a GPU a timed step costs a good part of
# another, so one in 8 cost a large model's batch-1 decode visibly, and even several a second
# did; one a second costs little and still gives 30 over the busy share's window.
PROFILE_EVERY = 8
PROFILE_SECONDS = 1.0
# The engine's gauges read from MLX (KV bytes, active and peak memory) are refreshed at most
# this often: read every step they cost a fast device's decode a few percent.
GAUGE_SECONDS = 0.25
WINDOW_SECONDS = 30  # what the busy share and the token rates look back over
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)
KINDS = ("decode", "prefill")
T = TypeVar("T")


class KVHolder(Protocol):
    """What holds a stage's KV (stage_state.StageState, which imports this module)."""

    def kv_bytes(self) -> int: ...


class _Window:
    """Running sums over the last WINDOW_SECONDS, kept per second: bounded at any step rate.
    The engine thread adds; a scrape (another thread) reads a copy."""

    def __init__(self, width: int):
        self.width = width
        self._seconds: deque[list[float]] = deque(maxlen=WINDOW_SECONDS + 1)
        self._start = time.monotonic()

    def add(self, *values: float) -> None:
        now = int(time.monotonic())
        if self._seconds and self._seconds[-1][0] == now:
            last = self._seconds[-1]
            for i, v in enumerate(values, 1):
                last[i] += v
        else:
            self._seconds.append([now, *values])

    def sums(self) -> tuple[list[float], float]:
        """Each value's sum over the window, and how long the window is (less after start)."""
        now = time.monotonic()
        recent = [s for s in list(self._seconds) if s[0] > now - WINDOW_SECONDS]
        return ([sum(s[i] for s in recent) for i in range(1, self.width + 1)],
                max(1.0, min(WINDOW_SECONDS, now - self._start)))


class StageProfile:
    """Times this stage's layers: every prefill chunk (a prefill is synchronous anyway) and one
    decode step in PROFILE_EVERY in a pipeline (one per PROFILE_SECONDS alone), which then runs
    synchronously: this stage's earlier work first, then its input (the wait for the previous
    stage), then its layers (its compute).
    The other decode steps run as before and count towards the busy share at the mean time of
    the timed ones."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        steps = Counter("omlx_node_stage_steps", "Steps this stage ran, by kind (decode, prefill)",
                        ["kind"], registry=r)
        compute = Histogram(
            "omlx_node_stage_compute_seconds",
            f"Time this stage's layers take per step, its input already in (every prefill chunk, "
            f"one decode step in {PROFILE_EVERY} in a pipeline, one per {PROFILE_SECONDS} s "
            f"alone)", ["kind"], buckets=STEP_BUCKETS, registry=r)
        wait = Histogram(
            "omlx_node_stage_receive_wait_seconds",
            "How long a timed step waited for its input from the previous stage (on the head: "
            "the tail's tokens) once this stage was ready for it", ["kind"],
            buckets=STEP_BUCKETS, registry=r)
        drafting = Counter(
            "omlx_node_stage_draft_seconds",
            "Host time this stage spent drafting tokens for speculative decoding (prompt "
            "lookup, a prediction, a draft model's passes), by kind: part of its steps' time "
            "that is not its layers'", ["kind"], registry=r)
        self.rows = Histogram("omlx_node_stage_step_rows", "Sequences per decode step",
                              buckets=ROW_BUCKETS, registry=r)
        Gauge("omlx_node_stage_busy_ratio",
              f"Share of the last {WINDOW_SECONDS} s this stage spent computing its layers",
              registry=r).set_function(self.busy_ratio)
        self._steps = {k: steps.labels(kind=k) for k in KINDS}
        self._compute = {k: compute.labels(kind=k) for k in KINDS}
        self._wait = {k: wait.labels(kind=k) for k in KINDS}
        self._drafting = drafting.labels(kind="decode")
        # The kinds of step whose input comes from another stage (set by the worker): in a
        # pipeline every step of a later stage, the head's decode steps (the tail's tokens).
        self.peer_inputs: frozenset[str] = frozenset()
        self.tokens = 0  # tokens computed since the last `NodeMetrics.iteration_done`
        self._decode_steps = 0
        self._timed_decodes = 0
        self._next_timed = 0.0  # perf_counter time from which the next decode step is timed
        self._last_kind = ""
        self._decode_mean = 0.0  # seconds, over the recent timed decode steps
        self._busy = _Window(1)  # compute seconds
        self._prefill = _Window(2)  # prompt tokens, compute seconds
        self._pending: tuple[str, int, float, list] | None = None  # see `settle`
        self._received = 0.0  # seconds the next decode step's input took to read (`receive`)
        self.prefill_s = 0.0  # seconds of the last timed prefill chunk

    def run(self, kind: str, x: mx.array, compute: Callable[[], mx.array],
            results: Callable[[mx.array], list] = lambda out: [out],
            wait: bool = True) -> mx.array:
        """`compute()`: this stage's layers on input `x` (rows, tokens, ...) in a step of `kind`;
        returns its output. A timed step evaluates `results(output)`: what the step is for
        (a prefill on the last stage keeps only its KV cache, and computing its unused output
        would run the last layer over every prompt position). `wait=False` (a timed step)
        schedules them instead, so that the caller builds its next step while the device
        computes this one; `settle` then takes its time."""
        self._steps[kind].inc()
        received = 0.0
        if kind == "decode":
            received, self._received = self._received, 0.0
        rows, tokens = x.shape[0], x.shape[0] * x.shape[1]
        self.tokens += tokens
        last, self._last_kind = self._last_kind, kind
        if kind == "decode":
            self.rows.observe(rows)
            self._decode_steps += 1
            if not self._due(last):
                self._busy.add(self._decode_mean)
                return compute()
            self._timed_decodes += 1
        self.settle()
        mx.synchronize()  # what this stage still computes belongs to earlier steps
        t0 = time.perf_counter()
        mx.eval(x)
        t1 = time.perf_counter()
        out = compute()
        if kind in self.peer_inputs:
            self._wait[kind].observe(t1 - t0 + received)
        if wait:
            mx.eval(results(out))
            self._record(kind, tokens, time.perf_counter() - t1)
        else:
            self._pending = (kind, tokens, t1, results(out))
            mx.async_eval(self._pending[3])
        return out

    def receive(self, read: Callable[[], T]) -> T:
        """`read()`: a blocking read, on the host, of the input of this stage's next decode
        step, made before that step is built (the head's, around steps that verify drafts: a
        draft follows the tokens, so `x` is on the host when `run` gets it). When that step is
        timed, its wait for its input is this read's, this stage's earlier work drained first
        as `run` does."""
        if "decode" not in self.peer_inputs or (self._decode_steps + 1) % PROFILE_EVERY:
            return read()
        self.settle()
        mx.synchronize()
        t0 = time.perf_counter()
        out = read()
        self._received = time.perf_counter() - t0
        return out

    def drafted(self, seconds: float) -> None:
        """Counts `seconds` of drafting (omlx_node.speculation.Speculator.draft)."""
        self._drafting.inc(seconds)

    def settle(self) -> None:
        """Takes the time of the step `run(wait=False)` left computing: from its start to its
        results, once the caller has built what it overlaps (so a step shorter than that
        build counts as long as the build)."""
        if self._pending is None:
            return
        (kind, tokens, t1, arrays), self._pending = self._pending, None
        mx.eval(arrays)
        self._record(kind, tokens, time.perf_counter() - t1)

    def _record(self, kind: str, tokens: int, seconds: float) -> None:
        if kind == "prefill":
            self.prefill_s = seconds
        self._compute[kind].observe(seconds)
        self._busy.add(seconds)
        if kind == "decode":  # the mean of the first 16 timed steps, then a moving one
            self._decode_mean += (seconds - self._decode_mean) / min(self._timed_decodes, 16)
            self._next_timed = time.perf_counter() + PROFILE_SECONDS
        else:
            self._prefill.add(tokens, seconds)

    def _due(self, last: str) -> bool:
        """Whether this decode step is timed (`last`: the kind of the step before it)."""
        if self.peer_inputs:  # a pipeline: the same steps on every stage
            return self._decode_steps % PROFILE_EVERY == 0
        # Preferably one that follows a decode step: the first after a prefill (or an idle
        # spell) also merges new rows into the batch, and picking it because the deadline
        # passed during that prefill would overstate the step.
        wait = self._next_timed - time.perf_counter()
        return wait <= 0 and (last == "decode" or wait <= -PROFILE_SECONDS)

    def busy_ratio(self) -> float:
        (busy,), span = self._busy.sums()
        return min(1.0, busy / span)

    def prompt_rate(self) -> float:
        """Prompt tokens per second of this stage's prefill compute, over the window."""
        (tokens, seconds), _ = self._prefill.sums()
        return tokens / seconds if seconds > 0 else 0.0


class _MachineCollector:
    """The process's real footprint and the machine's memory pressure, read at each scrape
    (files on Linux, libSystem calls on macOS: no MLX, so safe off the engine thread)."""

    PROBES = (
        ("omlx_node_process_footprint_bytes",
         ("Memory this worker really uses, by what measured it (Linux: PSS, macOS: "
          "phys_footprint)"), process_footprint),
        ("omlx_node_memory_pressure",
         ("How short of memory the machine is, 0 to 1 (Linux: share of the last 10 s some "
          "task stalled on memory, PSI; macOS: 1 - kern.memorystatus_level / 100)"),
         memory_pressure),
    )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Names it, so that a scrape asking for other series (`name[]=`) skips its probes.
        for name, documentation, _ in self.PROBES:
            yield GaugeMetricFamily(name, documentation, labels=["source"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, probe in self.PROBES:
            try:
                reading = probe()
            except OSError:  # a call macOS refused: left out of this scrape
                continue
            if reading is not None:
                family = GaugeMetricFamily(name, documentation, labels=["source"])
                family.add_metric([reading[0]], reading[1])
                yield family


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("omlx_node_requests", "Sequences submitted", registry=r)
        self.finished = Counter(
            "omlx_node_requests_finished", "Sequences finished, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("omlx_node_prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter(
            "omlx_node_tokens_predicted", "Tokens generated", registry=r
        )
        self.running = Gauge("omlx_node_requests_processing", "Sequences decoding", registry=r)
        self.waiting = Gauge(
            "omlx_node_requests_deferred", "Sequences queued or prefilling (the queue depth)",
            registry=r
        )
        self.ttft = Histogram(
            "omlx_node_time_to_first_token_seconds",
            "From submission to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "omlx_node_inter_token_latency_seconds",
            "Between consecutive tokens of a sequence",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "omlx_node_request_queue_seconds", "From submission to the start of its prefill",
            buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Histogram(
            "omlx_node_request_prefill_seconds",
            "From the start of its prefill to its first token", buckets=LATENCY_BUCKETS,
            registry=r)
        self.wait_seconds = Histogram(
            "omlx_node_request_wait_seconds",
            "Of a request's time to its first token, what the engine was doing: the running "
            "rows' decode steps, its own prompt's prefill, other prompts' prefill",
            ["part"], buckets=LATENCY_BUCKETS, registry=r)
        self.decode_seconds = Histogram(
            "omlx_node_request_decode_seconds", "From its first token to its end",
            buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            "omlx_node_iteration_tokens",
            "Tokens one engine iteration computed, decode rows and prefill chunk (on a later "
            "stage: per step)", buckets=TOKEN_BUCKETS, registry=r)
        self.micro_batches = Gauge(
            "omlx_node_micro_batches", "Micro-batches the pipeline head spreads new sequences "
            "over (1: lockstep)", registry=r
        )
        self.load_seconds = Gauge("omlx_node_shard_load_seconds", "Time to load the shard", registry=r)
        self.shard_bytes = Gauge("omlx_node_shard_bytes", "Weight bytes of the loaded shard", registry=r)
        self.kv_bytes = Gauge(
            "omlx_node_kv_cache_used_bytes",
            "KV cache bytes of the sequences this stage holds, decoding or prefilling",
            registry=r)
        self.mlx_active = Gauge("omlx_node_mlx_active_bytes", "MLX's allocated memory in use",
                                registry=r)
        self.mlx_peak = Gauge("omlx_node_mlx_peak_bytes", "MLX's peak allocated memory",
                              registry=r)
        # Freed buffers MLX keeps for reuse: part of the process's RSS that active memory
        # does not count, so a soak can tell a growing allocator cache from a leak.
        self.mlx_cache = Gauge("omlx_node_mlx_cache_bytes",
                               "Memory MLX's allocator holds freed, for reuse", registry=r)
        # Made once the shard's weights are loaded (worker.run_worker), on the engine's thread:
        # a later stage, idle until its first step, exports its weights rather than 0.
        self.mlx_active.set(mx.get_active_memory())
        self.mlx_peak.set(mx.get_peak_memory())
        self.mlx_cache.set(mx.get_cache_memory())
        self._gauges_due = 0.0  # monotonic time of the next refresh in iteration_done
        self.profile = StageProfile(r)
        Gauge("omlx_node_prompt_tokens_seconds",
              f"Prompt tokens this stage prefilled per second of prefill, last {WINDOW_SECONDS} s",
              registry=r).set_function(self.profile.prompt_rate)
        self._predicted = _Window(1)
        Gauge("omlx_node_predicted_tokens_seconds",
              f"Tokens generated per second, last {WINDOW_SECONDS} s",
              registry=r).set_function(self.predicted_rate)
        self._speculative_counts()
        r.register(_MachineCollector())

    def _speculative_counts(self) -> None:
        """Speculative decoding's series (omlx_node.speculation): what it drafted and what
        stood, by draft source, and the two ratios a dashboard wants."""
        r, self._spec = self.registry, [0, 0, 0]  # drafted, accepted, row steps
        self.spec_drafted = Counter(
            "omlx_node_speculative_draft_tokens", "Draft tokens verified, by source",
            ["source"], registry=r)
        self.spec_accepted = Counter(
            "omlx_node_speculative_accepted_tokens", "Draft tokens that stood, by source",
            ["source"], registry=r)
        self.spec_steps = Counter(
            "omlx_node_speculative_row_steps",
            "Steps of one row that verified a draft (each gives its accepted tokens + 1)",
            ["source"], registry=r)
        self.spec_max_rows = Gauge(
            "omlx_node_speculative_max_rows",
            "Most rows a step may hold and still speculate, measured at start-up (0: off)",
            registry=r)
        Gauge("omlx_node_speculative_acceptance_rate",
              "Accepted / drafted tokens since start (0 before any draft)",
              registry=r).set_function(lambda: self._spec[1] / max(self._spec[0], 1))
        Gauge("omlx_node_speculative_tokens_per_step",
              "Tokens a row got from a step that verified its draft, mean since start",
              registry=r).set_function(
                  lambda: (self._spec[1] + self._spec[2]) / max(self._spec[2], 1))

    def speculated(self, source: str, drafted: int, accepted: int) -> None:
        """One row's verified draft: `drafted` tokens from `source`, `accepted` of them stood."""
        self.spec_drafted.labels(source=source).inc(drafted)
        self.spec_accepted.labels(source=source).inc(accepted)
        self.spec_steps.labels(source=source).inc()
        self._spec[0] += drafted
        self._spec[1] += accepted
        self._spec[2] += 1

    def waited(self, parts: Mapping[str, float]) -> None:
        """Where one request's time to its first token went (omlx_node.wait_parts)."""
        for part, seconds in parts.items():
            self.wait_seconds.labels(part=part).observe(seconds)

    def tokens_generated(self, n: int) -> None:
        self.generated_tokens.inc(n)
        self._predicted.add(n)

    def predicted_rate(self) -> float:
        (tokens,), span = self._predicted.sums()
        return tokens / span

    def iteration_done(self, state: KVHolder) -> None:
        """After each engine iteration (each step on a later stage), on the engine thread:
        MLX is only asked from there."""
        busy = self.profile.tokens
        if busy:
            self.iteration_tokens.observe(busy)
            self.profile.tokens = 0
        now = time.monotonic()
        if busy and now < self._gauges_due:  # an idle iteration leaves them right
            return
        self._gauges_due = now + GAUGE_SECONDS
        self.kv_bytes.set(state.kv_bytes())
        self.mlx_active.set(mx.get_active_memory())
        self.mlx_peak.set(mx.get_peak_memory())
        self.mlx_cache.set(mx.get_cache_memory())

    def serve(self, host: str, port: int, identity: Mapping[str, str]) -> int:
        """Exports /metrics over HTTP, every series labelled with `identity` (IDENTITY_LABELS);
        returns the bound port (useful when port is 0)."""
        server, _ = start_http_server(port, addr=host, registry=labelled(self.registry, identity))
        return server.server_port
