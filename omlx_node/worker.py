"""Shard worker: the only process that runs MLX model code. One per node per plan.

It joins the plan's mx.distributed group (when the pipeline has more than one stage) and links
each stage to the next one's doorbell (`omlx_node.wire`), loads its layers, and runs the engine
on its main thread: rank 0 the head's (`Batcher` alone, `PipelineHead` in a pipeline) behind the
ShardWorker gRPC service, every other rank a `StageLoop`. It writes its ready file only once it
can serve, and exits when its agent (its parent) does.

SIGTERM stops it cleanly: the head finishes its sequences as "aborted", drains the answers it is
owed and sends STOP down the pipeline; every other stage ignores SIGTERM (its agent sends one at
the same moment) and exits on that STOP. Each rank exits 0 after a clean stop, 1 after a failure,
and logs which as its last line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

from omlx_shared import __version__, auth, cluster_tls
from omlx_shared.child import on_stop_signals, write_ready
from omlx_shared.heap import freeze_startup_heap
from omlx_shared.speculative_modes import check_mode, draft_path
from omlx_node.batcher import Batcher, Engine
from omlx_node.constraints import Grammars
from omlx_node.draft_model import draft_for
from omlx_node.kv_cache import PrefixCache
from omlx_node.kv_cache.blocks import Layout, cache_layout
from omlx_node.kv_cache.device_tier import default_max_bytes
from omlx_node.load_priority import (at_low_priority, idle_class, load_nice, materialized,
                                     reason_name, thread_nice)
from omlx_node.metrics import KINDS, NodeMetrics
from omlx_node.session import Session
from omlx_node.stage import StageRunner
from omlx_node.warm_up import warm_up
from omlx_node.wire import Doorbell, link_doorbells
from omlx_node.worker_config import WorkerConfig, WorkerJob
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The most sequences a Session call carries, and calls the server runs at once (each Session
# holds two handler threads: requests, events).
MAX_STREAMS = 512


class WorkerService(pb_grpc.ShardWorkerServicer):
    """Session and Health of the head worker. Handlers never touch MLX: they talk to the
    engine through its queue and read each sequence's events back."""

    def __init__(self, engine: Engine, config: WorkerConfig, metrics_port: int):
        self.engine, self.config, self.metrics_port = engine, config, metrics_port
        self.session = os.environ.get(auth.SESSION_ENV)
        # Sessions' requests that carry a grammar are submitted here: its compile may take long.
        self.compiler = futures.ThreadPoolExecutor(max_workers=4,
                                                   thread_name_prefix="session-grammar")
        self._sessions: set[Session] = set()
        self._sessions_lock = threading.Lock()

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.session is None:
            return
        if not auth.check(self.session.encode(), auth.presented(context).encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "not admitted: calls to a shard worker need the cluster session")

    def Session(self, requests, context: grpc.ServicerContext):
        self._authorize(context)
        session = Session(self.engine, MAX_STREAMS, self.compiler,
                          self.config.engine.stream_interval)
        with self._sessions_lock:
            self._sessions.add(session)
        context.add_callback(lambda: session.close("the call ended"))
        threading.Thread(target=session.read, args=(requests,), name="session-requests",
                         daemon=True).start()
        try:
            yield from session.messages(context)
        finally:
            session.close("the call ended")
            with self._sessions_lock:
                self._sessions.discard(session)

    def close_sessions(self) -> None:
        """Ends every Session call (the engine has stopped, its sequences' last events out):
        a request sent later is told UNAVAILABLE, as a stopping server's new calls are."""
        with self._sessions_lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.close("the worker is shutting down")

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext):
        self._authorize(context)
        e, info, c = self.engine, self.engine.stage.info, self.config
        return pb.HealthReply(ready=e.ready, model_id=c.model_id, status=e.status,
                              version=__version__,
                              layer_start=info.layer_start, layer_end=info.layer_end,
                              num_layers=info.num_layers, metrics_port=self.metrics_port,
                              pid=os.getpid(), worker_pid=os.getpid(), rank=c.rank,
                              world_size=c.world_size)


def plan_int(plan_hash: str) -> int:
    return int(plan_hash[:8] or "0", 16)


def join_group(config: WorkerConfig):
    """Forms the plan's mx.distributed group, or exits naming the backend and what could not be
    reached: MLX's ring init waits forever for a missing peer, and jaccl's rank 0 for the
    others on its side channel."""
    import json
    import shutil
    import tempfile

    import mlx.core as mx

    rank, world, peers = config.rank, config.world_size, config.peers
    scratch = Path(tempfile.mkdtemp(prefix="omlx-group-"))
    os.environ["MLX_RANK"] = str(rank)
    if config.backend == "jaccl":
        host = peers[rank].rsplit(":", 1)[0]
        if not mx.distributed.is_available("jaccl"):
            raise SystemExit(f"error: this MLX build has no jaccl backend on {host} (RDMA over "
                             "Thunderbolt 5 needs MLX on macOS 26.2+ with RDMA enabled); use "
                             "--backend ring")
        try:
            row = json.loads(config.rdma_devices)[rank]
        except (ValueError, IndexError, TypeError):
            raise SystemExit(f"error: the plan's RDMA devices (rdma_devices) must be MLX's "
                             f"device matrix as JSON with a row for rank {rank}, got "
                             f"{config.rdma_devices!r}") from None
        devices = scratch / "devices.json"
        devices.write_text(config.rdma_devices)
        os.environ["MLX_IBV_DEVICES"] = str(devices)
        # Rank 0 listens there for the others to exchange their RDMA queue pairs; the ring
        # variant connects each rank to its two neighbours only, as the pipeline sends.
        os.environ["MLX_JACCL_COORDINATOR"] = peers[0]
        os.environ["MLX_JACCL_RING"] = "1"
        links = ", ".join(f"{'+'.join(d) if isinstance(d, list) else d} to rank {r}"
                          for r, d in enumerate(row) if d) or "none"
        where = (f"rank {rank} of {world} on {host}, side channel at rank 0's {peers[0]}, "
                 f"RDMA devices {links}")
        hint = "Is every node of the plan up, RDMA-enabled and cabled to its ring neighbours?"
    else:
        hostfile = scratch / "hosts.json"
        hostfile.write_text(json.dumps([[p] for p in peers]))
        os.environ["MLX_HOSTFILE"] = str(hostfile)
        where = f"rank {rank} of {world}, listening on {peers[rank]}, peers {', '.join(peers)}"
        hint = "Is every node of the plan up and reachable?"

    message = (f"error: could not form the {config.backend} group within "
               f"{config.init_timeout:.0f}s: {where}. {hint}")
    # MLX's init holds the GIL while it waits, so no thread or signal handler of this process
    # can run: a separate watchdog process ends it.
    watchdog = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; time.sleep(float(sys.argv[1])); "
         "print(sys.argv[2], file=sys.stderr, flush=True); os.kill(int(sys.argv[3]), 9)",
         str(config.init_timeout), message, str(os.getpid())])
    try:
        group = mx.distributed.init(strict=True, backend=config.backend)
    except RuntimeError as e:  # e.g. a jaccl device that cannot be opened, a refused connection
        raise SystemExit(f"error: could not form the {config.backend} group: {e} ({where})"
                         ) from None
    finally:
        watchdog.kill()
        watchdog.wait()
        shutil.rmtree(scratch, ignore_errors=True)  # MLX read its files in init
    if group.size() != world or group.rank() != rank:
        raise RuntimeError(f"joined a group of {group.size()} as rank {group.rank()}, expected "
                           f"{world} / {rank}")
    return group


def weights_fingerprint(model_path: Path) -> str:
    """Names the exact weights for the prefix cache: config plus every safetensors header,
    size and mtime (cheap; hashing gigabytes of tensors at start-up is not). A shard folder
    received from the coordinator is named by its model's content fingerprint instead: it gains
    files as re-plans move this node's range, and the blocks of its layers stay valid."""
    from omlx_shared.model_store import read_shard_record

    if (record := read_shard_record(model_path)) is not None:
        return record.fingerprint[:12]
    h = hashlib.sha256(model_path.joinpath("config.json").read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        st = f.stat()
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 24)))
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def block_layout(stage: StageRunner, block_size: int) -> Layout:
    """The layout of the stage's prefix-cache blocks, from one token through fresh caches.
    Given to its cache, a block on disk of other shapes (written by an mlx-lm that kept this
    family's KV otherwise) is a miss from the first request on, not a failed step for the
    request's whole batch."""
    import mlx.core as mx

    cache = stage.make_cache()
    mx.eval(stage(stage.sample_input(1, 1), cache))
    return cache_layout(cache, block_size)


def make_prefix_cache(config: WorkerConfig, stage: StageRunner, metrics: NodeMetrics,
                      tensor_group=None) -> PrefixCache | None:
    """`tensor_group`: the ranks of a tensor-parallel stage keep a prefix cache only if every
    one does (its lookups and `block_layout`'s forward pass are collective), each of its heads."""
    wanted = config.engine.hot_cache_bytes > 0
    name = f"{config.model_id}@{weights_fingerprint(config.model_path)}"
    if tensor_group is not None:
        import mlx.core as mx

        wanted = bool(mx.distributed.all_min(mx.array([int(wanted)]), group=tensor_group).item())
        name += f"/tensor{tensor_group.rank()}of{tensor_group.size()}"
    if not wanted:
        return None
    info, engine = stage.info, config.engine
    layout = None if stage.prefix_cache_off else block_layout(stage, engine.cache_block_size)
    return PrefixCache(
        name,
        (info.layer_start, info.layer_end), engine.cache_block_size,
        hot_max_bytes=engine.hot_cache_bytes,
        ssd_dir=Path(engine.ssd_cache_dir) if engine.ssd_cache_dir else None,
        ssd_max_bytes=engine.ssd_cache_bytes, metrics_registry=metrics.registry,
        dtype=info.dtype,
        device_max_bytes=(default_max_bytes() if engine.device_cache_bytes is None
                          else engine.device_cache_bytes), layout=layout)


def any_rank(flag: bool, group) -> bool:
    """Whether `flag` holds on any rank of `group`: a collective, which each of them calls."""
    import mlx.core as mx

    return bool(mx.distributed.all_sum(mx.array([int(flag)]), group=group).item())


def tensor_stage_group(config: WorkerConfig, group):
    """The group this rank's tensor-parallel stage computes over: the plan's whole group for
    one tensor stage, this rank's run of it in a pipeline of tensor stages
    (omlx_node/sub_group.py); None for a rank that holds whole layers."""
    if config.tensor:
        return group
    first, size = config.tensor_stage()
    if size == 1:
        return None
    from omlx_node import sub_group

    sub_group.install()
    return sub_group.SubGroup(group, first, size)


def head_costs(config: WorkerConfig, stage: StageRunner,
               tensor_group=None) -> dict[int, float] | None:
    """What the head's engine calibrates on, measured as part of the load (on its thread, at
    its priority) rather than on the serving thread once it serves: speculation's cost curve
    by positions (kept for its Speculator: speculation.position_costs) where the engine may
    speculate, and the curve by rows a pipeline head's micro-batches follow, which is returned
    (None where none is wanted). A tensor-parallel stage measures on every rank at once, on its
    group's thread (speculation.collective_position_costs), not here."""
    if config.rank != 0 or config.tensor:
        return None
    from omlx_node.calibrate import row_costs
    from omlx_node.speculation import position_costs

    if config.engine.speculative != "off" and stage.trimmable and tensor_group is None:
        position_costs(stage)
    if config.world_size > 1 and tensor_group is None and not config.micro_batches:
        return row_costs(stage.feed_forward(), stage.hidden_size, stage.info.dtype)
    return None


def uses_grammars(config: WorkerConfig) -> bool:
    """Whether this rank needs the model's grammar tokenizer: the head checks grammars at
    submit, the tail applies them."""
    return config.rank == 0 or (config.rank == config.world_size - 1 and not config.tensor)


def load_draft(config: WorkerConfig, stage: StageRunner) -> None:
    """The draft model of a head whose engine drafts with one (`draft=PATH`), loaded with its
    target (draft_model.draft_for), its arrays evaluated here."""
    path = draft_path(check_mode(config.engine.speculative))
    if path and stage.trimmable:
        materialized(draft_for(path, stage).stage)


def finish_load(config: WorkerConfig, stage: StageRunner, grammars: Grammars,
                tensor_group=None) -> tuple[float, int, dict[int, float] | None]:
    """The load's last part, on the loading thread at the load's priority like the weights
    (in place on a tensor stage, whose group belongs to this thread): the warm-up, the grammar
    tokenizer of a rank that `uses_grammars`, and what the head's engine calibrates on
    (`head_costs`), once that tokenizer is built: a CPU's calibration counts the process's CPU
    seconds, which nothing else may spend meanwhile.
    Its draft model (`load_draft`) too. Returns the warm-up's seconds, the nice value that
    thread read, and `head_costs`' curve."""
    def work() -> tuple[float, int, dict[int, float] | None]:
        nice = thread_nice()
        seconds = warm_up(stage)
        if uses_grammars(config):
            # Built here, not on the first request to need it: that one would wait for a
            # thread at the load's priority, which beside busy workers gets next to no CPU.
            grammars.wait()
        if config.rank == 0:
            load_draft(config, stage)
        return seconds, nice, head_costs(config, stage, tensor_group)

    return at_low_priority(work, elsewhere=tensor_group is None,
                           nice=load_nice(config.load_reason))


def run_worker(config: WorkerConfig, ready_file: Path | None) -> int:
    """The worker process's life; returns its exit code (a rank of a pipeline exits itself)."""
    if config.kind not in ("", "chat"):
        from omlx_node.encoder_worker import run_encoder_worker
        return run_encoder_worker(config.model_path, config.model_id, config.kind, config.host,
                                  ready_file, config.load_reason)
    grammars = Grammars(config.model_path)
    nice = load_nice(config.load_reason)
    if uses_grammars(config):
        # Their tokenizer is built while the group forms and the weights load, at the load's
        # priority.
        grammars.warm(nice)
    group, doorbells = None, (None, None)
    if config.world_size > 1:
        group = join_group(config)
        doorbells = link_doorbells(group, config.peers, config.init_timeout)
    tensor_group = tensor_stage_group(config, group)
    # A tensor stage's load and warm-up run collectives on its group, which belongs to this
    # thread: they run here at the worker's priority.
    log.info("rank %d: loading at nice %d%s (%s)", config.rank, nice,
             ", SCHED_IDLE" if idle_class(nice) and tensor_group is None else "",
             reason_name(config.load_reason))
    stage = at_low_priority(lambda: StageRunner(
        config.model_path, config.layer_start, config.layer_end,
        streamed=config.streamed_layers, tensor_group=tensor_group, split_head=config.tensor),
        elsewhere=tensor_group is None, nice=nice)
    metrics = NodeMetrics()
    prefix_cache = make_prefix_cache(config, stage, metrics, tensor_group)
    try:
        code = _serve(config, ready_file, group, doorbells, stage, metrics, prefix_cache,
                      grammars, tensor_group)
    finally:
        if prefix_cache is not None:
            prefix_cache.close()
    log.info("rank %d of %d exits with code %d", config.rank, config.world_size, code)
    if group is not None:
        # MLX's ring backend is slow to tear down at interpreter exit (mlx 0.32,
        # even once the group is dropped): longer than an agent waits for a worker it stops,
        # which then kills it. Everything is flushed and closed by now: end here.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _serve(config: WorkerConfig, ready_file: Path | None, group,
           doorbells: tuple[Doorbell | None, Doorbell | None], stage: StageRunner,
           metrics: NodeMetrics, prefix_cache: PrefixCache | None, grammars: Grammars,
           tensor_group=None) -> int:
    """`doorbells`: this rank's (upstream, downstream) in a pipeline (wire.link_doorbells);
    `tensor_group`: `tensor_stage_group`'s."""
    from omlx_node.pipeline import PipelineHead, StageLoop, micro_batches_worth
    from omlx_node.speculation import collective_position_costs
    from omlx_node.tensor import TensorFollower, TensorHead

    metrics.load_seconds.set(stage.info.load_seconds)
    metrics.shard_bytes.set(stage.nbytes())
    info = stage.info
    log.info("rank %d/%d: layers [%d, %d) of %s loaded in %.1fs (%s%s)", config.rank,
             config.world_size, info.layer_start, info.layer_end, config.model_id,
             info.load_seconds, info.dtype,
             f"; the last {stage.streamed_layers} stream from disk" if stage.streamed_layers
             else "")
    # Before it says it is ready: the first request after a load, a re-plan or a failover
    # would otherwise wait for MLX to build every kernel it runs.
    warmed, niced, by_rows = finish_load(config, stage, grammars, tensor_group)
    log.info("rank %d: warmed up in %.2fs", config.rank, warmed)
    ready = {"pid": os.getpid(), "dtype": info.dtype, "load_seconds": info.load_seconds,
             "layer_start": info.layer_start, "layer_end": info.layer_end,
             "num_layers": info.num_layers, "port": 0, "load_nice": niced}
    plan = plan_int(config.plan_hash)
    # Every stage exports, labelled with which one it is: a pipeline's slowest stage shows.
    if group is not None:
        metrics.profile.peer_inputs = frozenset({"decode"} if config.rank == 0 else KINDS)
    ready["metrics_port"] = metrics.serve(config.host, config.metrics_port, {
        "node": config.node_id, "model": config.model_id, "plan": config.plan_hash,
        "stage": str(config.rank), "layers": f"{info.layer_start}:{info.layer_end}"})

    freeze_startup_heap()  # the loaded model and every module: no full collection walks them
    tensor_costs = None
    # The head's stage sets the cost of a step's extra positions for its drafts: where it is
    # tensor-parallel (alone, or first of a pipeline's), every rank of it measures at once,
    # before the others wait for steps: the sharded MLP's all_sums need them all.
    # Whether to is agreed first: nodes that joined with other --speculative flags (and no
    # model's own mode) would otherwise leave some ranks measuring while the others wait.
    head_stage = config.tensor or (tensor_group is not None and config.tensor_stage()[0] == 0)
    if head_stage and any_rank(config.engine.speculative != "off", tensor_group):
        tensor_costs = collective_position_costs(stage)
    if config.rank > 0:
        # The head's STOP ends this stage: a SIGTERM (its agent stopping with the head's) would
        # kill it before that STOP lands, and rank 0 would fail sending it. An agent that cannot
        # wait kills it instead.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        if ready_file:
            write_ready(ready_file, ready)
        if config.tensor:
            TensorFollower(stage, group, plan, prefix_cache, metrics, doorbells).run()
        else:
            first, size = config.tensor_stage()
            StageLoop(stage, group, plan, prefix_cache, grammars, metrics, doorbells,
                      relay=config.rank + 1 < first + size).run()
        return 0

    settings = config.engine
    if config.tensor:
        engine: Engine = TensorHead(stage, metrics, group, plan, doorbells[1],
                                    settings.prefill_chunk, settings.max_batch, prefix_cache,
                                    grammars, settings.speculative, settings.speculative_rows,
                                    tensor_costs)
    elif group is None:
        engine = Batcher(stage, metrics, settings.prefill_chunk, settings.max_batch,
                         prefix_cache, grammars, settings.speculative, settings.speculative_rows)
    elif tensor_group is not None:
        # Rank 0 of a pipeline of tensor stages: the micro-batches' cost curve by rows would
        # need its stage's other ranks, which wait for steps, so every micro-batch is used;
        # its drafts' curve they measured with it above (docs/cluster.md).
        engine = PipelineHead(stage, metrics, group, plan, doorbells[1],
                              config.micro_batches or len(config.stage_ranks),
                              settings.prefill_chunk, settings.max_batch, prefix_cache, None,
                              grammars, settings.speculative, settings.speculative_rows,
                              relay=True, spec_costs=tensor_costs)
    else:
        costs = by_rows
        stages = len(config.stage_ranks) or config.world_size
        if costs is not None:
            log.info("decode step cost by rows (one layer's MLP, us): %s; micro-batches pay "
                     "off from %s rows", {r: round(c * 1e6) for r, c in costs.items()},
                     next((r for r in (2 ** i for i in range(1, 12))
                           if micro_batches_worth(costs, r, stages) > 1), "no"))
        engine = PipelineHead(stage, metrics, group, plan, doorbells[1],
                              config.micro_batches or stages, settings.prefill_chunk,
                              settings.max_batch, prefix_cache, costs, grammars,
                              settings.speculative, settings.speculative_rows)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_STREAMS + 16),
                         maximum_concurrent_rpcs=MAX_STREAMS)
    service = WorkerService(engine, config, ready["metrics_port"])
    pb_grpc.add_ShardWorkerServicer_to_server(service, server)
    port = cluster_tls.add_port(server, f"{config.host}:0", cluster_tls.Credentials.from_env())
    server.start()
    on_stop_signals(engine.stop)
    if ready_file:
        write_ready(ready_file, {**ready, "port": port})
    engine.run()
    service.close_sessions()
    if isinstance(engine, (PipelineHead, TensorHead)):
        engine.shutdown_pipeline()
    server.stop(grace=2).wait(5)
    return 0 if engine.ready else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m omlx_node.worker --ready-file F`: a worker started by its node agent (or a
    test), which reads its WorkerJob as one JSON line on stdin. Started ahead of its plan (a
    standby), it has imported MLX and mlx-lm by the time the line comes."""
    import argparse

    from omlx_shared.child import watch_parent
    from omlx_shared.typed_json import ConfigError

    parser = argparse.ArgumentParser(prog="python -m omlx_node.worker")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--ready-file", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A worker is only ever its agent's: when the agent goes, so does it.
    watch_parent(lambda: os._exit(0))
    line = sys.stdin.readline()
    if not line:  # the agent went away without a plan for us
        return 0
    try:
        job = WorkerJob.from_json(line)
    except ConfigError as e:
        print(f"error: the worker's job: {e}", file=sys.stderr)
        return 2
    os.environ.update(job.env)
    return run_worker(job.config, args.ready_file)


if __name__ == "__main__":
    sys.exit(main())
