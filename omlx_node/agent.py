"""Node agent: the long-lived process of one node. It serves the NodeAgent gRPC service and owns
the node's shard worker processes, one per model, replacing a model's worker on every new plan
of that model. The agent never runs MLX, so it survives whatever happens to a worker.
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from omlx_node.kept_workers import KeptWorkers
from omlx_node.load_priority import load_nice
from omlx_node.standby import import_nice, imported
from omlx_node.stay_awake import StayAwake
from omlx_node.thunderbolt import rdma_ports
from omlx_node.weight_store import WeightError, WeightStore
from omlx_node.worker_config import WorkerConfig, WorkerJob, start_worker, worker_process
from omlx_shared import __version__, auth, checks, cluster_tls, hardware, link_probe
from omlx_shared.child import ChildError, ChildProcess, on_stop_signals, watch_parent
from omlx_shared.engine_config import EngineConfig
from omlx_shared.heap import freeze_startup_heap
from omlx_shared.node_identity import default_node_id
from omlx_shared.outsider_logs import cut
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_SECONDS = 1800.0  # joining the group and loading a large shard
PENDING_HANDSHAKES = 16  # begun and not yet admitted; older ones are dropped
NONCES_REMEMBERED = 4096  # coordinator nonces seen: a replayed Handshake is refused
UNLOAD_GRACE_SECONDS = 10.0  # UnloadShard's default between SIGTERM and SIGKILL
# A worker replaced by a new plan of its model: a stage blocked on a dead peer cannot run its
# SIGTERM handler, so do not wait long (a healthy one flushes its prefix cache well within this).
REPLACE_GRACE_SECONDS = 1.0
# How often Health's view of each worker's memory is refreshed. Each probe walks the worker's
# page tables (PSS): every second, with the worker's full /metrics read as well, that kept an
# idle host's agent and a large model's worker busy (bench/results/idle-cpu-h200.md).
PROBE_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 0.5  # a worker whose /metrics is slower keeps its last reading
# The gauge the worker exports MLX's active memory as (omlx_node/metrics.py: importing that
# module would load MLX into the agent).
MLX_ACTIVE_METRIC = "omlx_node_mlx_active_bytes"
ACCEPTANCE_METRIC = "omlx_node_speculative_acceptance_rate"
TOKENS_PER_STEP_METRIC = "omlx_node_speculative_tokens_per_step"
ORPHAN_CHECK_SECONDS = 1.0  # how often a node looks whether its coordinator is still there
ABANDON_CHECK_SECONDS = 0.5  # how often a load waiting for another looks whether it was dropped
MAX_PROBE_SECONDS = 60.0  # a link probe's longest wait for its peer, whatever was asked


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def model_key(request: pb.LoadShardRequest) -> str:
    """The model a LoadShard is for: its workers are keyed by it."""
    return request.model_id or os.path.basename(request.model_path)


def reachable(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard: over loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def scrape_gauges(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The first sample of each of gauges `names` on a Prometheus text endpoint (one request);
    those the endpoint lacks, or all when it does not answer in time, are left out."""
    query = urllib.parse.urlencode([("name[]", n) for n in names])  # those alone: cheap
    try:
        with urllib.request.urlopen(f"{url}?{query}", timeout=PROBE_TIMEOUT_SECONDS) as response:
            text = response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):  # a worker busy, exiting or stopped
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if (name not in found and line.startswith(name)
                    and line[len(name):len(name) + 1] in ("{", " ")):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found


def stop_process(child: ChildProcess, grace: float) -> bool:
    """SIGTERM, then SIGKILL after `grace` seconds; returns once it has exited, True if it had
    to be killed."""
    running = child.alive()
    child.stop(timeout=grace)
    return running and child.proc.returncode == -signal.SIGKILL


@dataclass
class Worker:
    """One model's shard worker, as its LoadShard started it."""

    process: ChildProcess
    request: pb.LoadShardRequest
    reply: pb.LoadShardReply
    metrics_port: int  # the port its /metrics bound
    footprint_bytes: int = 0  # as last probed
    mlx_active_bytes: int = 0
    acceptance_rate: float = 0.0  # speculative decoding's, as last probed
    tokens_per_step: float = 0.0

    def probe(self, host: str) -> None:
        """Reads its real footprint and MLX's active memory (from its own /metrics: only the
        worker may ask MLX). Slow for a large process (PSS walks every mapping's pages): run
        off Health's path."""
        try:
            reading = hardware.process_footprint(self.process.pid)
        except OSError:  # macOS refused, or it has exited
            reading = None
        self.footprint_bytes = reading[1] if reading and self.process.alive() else 0
        read = scrape_gauges(f"http://{reachable(host)}:{self.metrics_port}/metrics",
                             (MLX_ACTIVE_METRIC, ACCEPTANCE_METRIC, TOKENS_PER_STEP_METRIC)
                             ) if self.metrics_port else {}
        if MLX_ACTIVE_METRIC in read:
            self.mlx_active_bytes = int(read[MLX_ACTIVE_METRIC])
        self.acceptance_rate = read.get(ACCEPTANCE_METRIC, self.acceptance_rate)
        self.tokens_per_step = read.get(TOKENS_PER_STEP_METRIC, self.tokens_per_step)

    def status(self) -> pb.WorkerStatus:
        alive, r, q = self.process.alive(), self.reply, self.request
        return pb.WorkerStatus(
            model_id=r.model_id, ready=alive,
            status="ready" if alive else "the shard worker exited", pid=r.worker_pid,
            metrics_port=self.metrics_port, worker_address=r.worker_address,
            layer_start=r.layer_start, layer_end=r.layer_end, num_layers=r.num_layers,
            rank=q.rank, world_size=max(1, q.world_size), plan_hash=q.plan_hash,
            footprint_bytes=self.footprint_bytes if alive else 0,
            mlx_active_bytes=self.mlx_active_bytes if alive else 0,
            speculative_acceptance_rate=self.acceptance_rate,
            speculative_tokens_per_step=self.tokens_per_step)


def machine_memory_fields() -> dict:
    """HealthReply's memory fields, read now (a few small /proc files or sysctls)."""
    fields: dict = {"memory_total_bytes": hardware.machine_memory()}
    try:
        fields["memory_available_bytes"] = hardware.available_memory() or 0
        fields["memory_pressure"] = hardware.pressure_level()
    except OSError:  # a sysctl macOS refused: left out of this reply
        pass
    return fields


class NodeAgent(pb_grpc.NodeAgentServicer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_port: int = 0,
                 metrics_port: int = 0, engine: EngineConfig | None = None,
                 secret: str | None = None, node_id: str = "", chip: str = "",
                 speed: float = 0.0, standby: bool = True, worker_cache_bytes: int = 0,
                 weights_cap: int = 0, disk_gbps: float = 0.0,
                 orphan_grace: float = 0.0, layer_ms: float = 0.0):
        self.secret = secret
        # A coordinator calls Health every heartbeat: silent this long (0: never checked), it
        # is gone for good, and the workers' memory goes back to the Mac's owner.
        self.orphan_grace = orphan_grace
        self._heard = time.monotonic()  # the last authorized call from a coordinator
        self.node_id = node_id or default_node_id()
        self.chip = chip or hardware.chip()
        self.speed = speed
        self.layer_ms = layer_ms  # a layer's fixed cost a decode step (0: not measured)
        # Read once: the tools take seconds, and a recabled Mac joins again anyway.
        self.rdma_ports = rdma_ports()
        if self.rdma_ports:
            log.info("RDMA over Thunderbolt: %s", ", ".join(
                f"{p.device} ({'cabled' if p.peer_uuid else 'no cable'})"
                for p in self.rdma_ports))
        # Set by Admit, bound to the admitted coordinator's certificate (auth.bind); None: no
        # coordinator admitted us yet.
        self.session: str | None = None
        self.standby = standby
        self._standby: ChildProcess | None = None
        # With a secret, the control plane is mutual TLS under the secret's CA; the shard
        # workers serve with the same credentials.
        self.tls = (cluster_tls.issue(secret, cluster_tls.node_identity(self.node_id))
                    if secret else None)
        self._admission = threading.Lock()  # handlers run on a thread pool
        self._pending: dict[bytes, auth.Transcript] = {}  # node nonce -> its handshake
        self._seen_nonces: dict[bytes, None] = {}  # insertion-ordered: oldest first
        self.host = host
        self.data_port = data_port or free_port(host)
        # The first worker exports /metrics there, later ones (while it runs) on any free port:
        # a port binds once. 0: every worker on any port.
        self.metrics_port = metrics_port
        self.engine = engine or EngineConfig()  # every worker's engine settings
        self.worker_cache_bytes = worker_cache_bytes  # each worker's RAM prefix cache, for plans
        self.weights_cap = weights_cap  # its --weights-memory, for plans (0: none)
        self.disk_gbps = disk_gbps  # its disk's measured read speed (0: not measured)
        self.dequantizes = hardware.mlx_on_cpu()  # for the planner's quantization checks
        # One per model, in load order (a reload moves it last); a worker that exited stays
        # until it is replaced or unloaded, so Health reports it.
        self.workers: dict[str, Worker] = {}
        # Those of a model's previous plan, serving its last requests after a move.
        self.kept = KeptWorkers(lambda p: p.stop(timeout=REPLACE_GRACE_SECONDS))
        self._loading = False  # a LoadShard is in flight
        self._workers_lock = threading.Lock()  # UnloadShard and Health do not wait for a load
        self.status = "no shard loaded"  # what Health says while no worker is here
        self.awake = StayAwake()  # a power assertion against idle sleep while a shard is loaded
        self.checks: list[pb.NodeCheck] = []  # doctor's checks of this machine, once they ran
        threading.Thread(target=self._check_machine, name="checks", daemon=True).start()
        self.weights = WeightStore()  # layers received from the coordinator
        self._lock = threading.Lock()  # one plan change at a time
        self._shutdown = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_NodeAgentServicer_to_server(self, self.server)
        try:
            self.port = cluster_tls.add_port(self.server, f"{host}:{port}", self.tls)
        except RuntimeError:  # grpc's "Failed to bind" (it returns 0 on some versions instead)
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}: the port is in use (another "
                          f"node agent?) or the address is not this machine's; pick another "
                          f"with --port")

    # ---- gRPC ------------------------------------------------------------------------------

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext):
        if not auth.compatible(request.version, __version__):
            log.warning("refused coordinator %s: it runs omlx-cluster %s, this node %s",
                        context.peer(), cut(request.version), __version__)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"version mismatch: this node runs omlx-cluster {__version__}, the "
                          f"coordinator {request.version}; upgrade one of them")
        if self.tls is not None:
            self._require_coordinator(context)
        if not self._first_use(request.coordinator_nonce):
            log.warning("refused coordinator %s: a replayed or malformed handshake nonce",
                        context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "handshake refused: its nonce was used before or is malformed")
        n_nonce = auth.new_nonce()
        transcript = auth.Transcript(request.coordinator_nonce, n_nonce, self.node_id,
                                     cluster_tls.peer_fingerprint(context))
        with self._admission:
            while len(self._pending) >= PENDING_HANDSHAKES:
                self._pending.pop(next(iter(self._pending)))
            self._pending[n_nonce] = transcript
        return pb.HandshakeReply(
            node_id=self.node_id, version=__version__, node_nonce=n_nonce,
            proof=transcript.proof(self.secret, "node") if self.secret else b"",
            memory_bytes=hardware.machine_memory(), chip=self.chip, speed=self.speed,
            rdma_ports=self.rdma_ports, worker_cache_bytes=self.worker_cache_bytes,
            weights_cap_bytes=self.weights_cap, disk_gbps=self.disk_gbps,
            dequantizes=self.dequantizes, layer_ms=self.layer_ms)

    def Admit(self, request: pb.AdmitRequest, context: grpc.ServicerContext):
        cert = cluster_tls.peer_fingerprint(context)
        with self._admission:
            # Only a handshake made over a TLS session with this same coordinator certificate
            # can be admitted, and only once.
            match = next((t for t in self._pending.values() if t.coordinator_cert == cert and (
                self.secret is None or auth.check(t.proof(self.secret, "coordinator"),
                                                  request.proof))), None)
            if match is not None:
                self._pending.clear()
                self.session = (auth.bind(cert, match.session_token(self.secret))
                                if self.secret else "")
        if match is None:
            log.warning("refused coordinator %s: its admission proof does not match a handshake "
                        "of this connection (a wrong secret, a relay or a replay)",
                        context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "admission refused: the proof does not match a handshake made over "
                          "this connection with the cluster secret")
        log.info("admitted by the coordinator at %s", context.peer())
        return pb.AdmitReply()

    def _require_coordinator(self, context: grpc.ServicerContext) -> None:
        """The caller's certificate (gRPC verified it against the cluster CA) must name the
        coordinator: every node holds the CA too, and one may not admit itself onto another."""
        cert = cluster_tls.peer_certificate(context)
        if cert is None or cluster_tls.identity_of(cert) != cluster_tls.COORDINATOR:
            log.warning("refused %s: its certificate is not the coordinator's", context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "only the coordinator may admit a node")

    def _first_use(self, c_nonce: bytes) -> bool:
        """Remembers a coordinator nonce; False if it is malformed or was seen before."""
        if len(c_nonce) != auth.NONCE_BYTES:
            return False
        with self._admission:
            if c_nonce in self._seen_nonces:
                return False
            self._seen_nonces[c_nonce] = None
            while len(self._seen_nonces) > NONCES_REMEMBERED:
                self._seen_nonces.pop(next(iter(self._seen_nonces)))
        return True

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.secret is not None and (
                self.session is None
                or not auth.check(self.session.encode(), auth.presented(context).encode())):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "not admitted: the coordinator must handshake with the cluster secret")
        self._heard = time.monotonic()

    def LoadShard(self, request: pb.LoadShardRequest, context: grpc.ServicerContext):
        self._authorize(context)
        # Called when the call ends, however: a coordinator that gave up (a peer of the plan
        # was lost meanwhile) must not leave this node loading for a group that never forms.
        abandoned = threading.Event()
        context.add_callback(abandoned.set)
        try:
            return self.load(request, abandoned)
        except (ChildError, ValueError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def ProbeLink(self, request: pb.LinkProbeRequest, context: grpc.ServicerContext):
        self._authorize(context)
        # The probe listens on this node's data port: no load may bind it meanwhile, and one
        # in flight holds it already (the link is then measured at the next join).
        if not self._lock.acquire(timeout=ABANDON_CHECK_SECONDS):
            context.abort(grpc.StatusCode.UNAVAILABLE, "a shard is loading on this node; "
                          "its links are measured when it is idle")
        try:
            measured = link_probe.run_rank(
                request.rank, list(request.peers), request.nbytes or link_probe.DEFAULT_BYTES,
                timeout=min(max(request.timeout_seconds, 1.0), MAX_PROBE_SECONDS))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except link_probe.ProbeError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        finally:
            self.data_port = free_port(self.host)  # the probe's may linger in TIME_WAIT
            self._lock.release()
        if measured is None:
            return pb.LinkProbeReply()
        return pb.LinkProbeReply(gb_per_s=measured.gb_per_s, latency_us=measured.latency_us,
                                 nbytes=measured.nbytes)

    def UnloadShard(self, request: pb.UnloadShardRequest, context: grpc.ServicerContext):
        self._authorize(context)
        return self.unload(request.model_id, request.grace_seconds if request.grace_seconds > 0
                           else UNLOAD_GRACE_SECONDS, request.worker_pid)

    def PrepareWeights(self, request: pb.WeightManifest, context: grpc.ServicerContext):
        self._authorize(context)
        try:
            return self.weights.prepare(request)
        except WeightError as e:
            log.warning("weights refused: %s", e)
            context.abort(e.code, str(e))

    def PushWeights(self, request_iterator, context: grpc.ServicerContext):
        self._authorize(context)
        try:
            yield from self.weights.receive(request_iterator)
        except WeightError as e:
            log.warning("weight transfer aborted: %s", e)
            context.abort(e.code, str(e))
        except grpc.RpcError:  # the sender went away; its parts stay for the next attempt
            log.warning("weight transfer from %s broken off", context.peer())

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext):
        self._authorize(context)
        with self._workers_lock:
            workers = [w.status() for w in self.workers.values()]
        reply = pb.HealthReply(status=self.status, version=__version__, pid=os.getpid(),
                               data_port=self.data_port, checks=self.checks, workers=workers,
                               loading=self._loading, **machine_memory_fields())
        if workers:  # the top-level fields: the worker loaded last, for single-model readers
            last = workers[-1]
            reply.ready, reply.status, reply.model_id = last.ready, last.status, last.model_id
            reply.layer_start, reply.layer_end, reply.num_layers = (
                last.layer_start, last.layer_end, last.num_layers)
            reply.worker_pid, reply.metrics_port = last.pid, last.metrics_port
            reply.rank, reply.world_size = last.rank, last.world_size
        return reply

    @property
    def reply(self) -> pb.LoadShardReply | None:
        """The LoadShard reply of the worker loaded last; None while none is here."""
        with self._workers_lock:
            last = next(reversed(self.workers.values()), None)
        return last.reply if last is not None else None

    def _check_machine(self) -> None:
        """`omlx-cluster doctor`'s checks of this machine, once (system_profiler takes seconds):
        logged, and carried by every Health reply to `omlx-cluster status`."""
        results = checks.local_checks()
        checks.log_problems(results, log)
        self.checks = [pb.NodeCheck(**r.to_dict()) for r in results]

    # ---- plans -----------------------------------------------------------------------------

    def load(self, request: pb.LoadShardRequest,
             abandoned: threading.Event | None = None) -> pb.LoadShardReply:
        """Replaces the worker of `request`'s model with one for its plan; returns once it can
        serve. Raises ChildError once `abandoned` is set (the caller gave up)."""
        world = max(1, request.world_size)
        if world > 1 and len(request.peers) != world:
            raise ValueError(f"a plan of {world} stages needs {world} peers, got "
                             f"{len(request.peers)}")
        if not 0 <= request.rank < world:
            raise ValueError(f"rank {request.rank} is outside a plan of {world} stages")
        backend = request.backend or "ring"
        if world > 1 and backend not in ("ring", "jaccl"):
            raise ValueError(f"backend {backend!r}: a plan's data plane is ring or jaccl, "
                             "resolved by the coordinator")
        if world > 1 and backend == "jaccl" and not request.rdma_devices_json:
            raise ValueError("a jaccl plan needs its RDMA device matrix (rdma_devices_json)")
        while not self._lock.acquire(timeout=ABANDON_CHECK_SECONDS):  # another load runs
            if abandoned is not None and abandoned.is_set():
                raise ChildError("the coordinator gave up on this load while another ran")
        try:
            self._set_loading(True)
            return self._replace(model_key(request), request, abandoned)
        finally:
            self._set_loading(False)
            self._lock.release()

    def _replace(self, model_id: str, request: pb.LoadShardRequest,
                 abandoned: threading.Event | None) -> pb.LoadShardReply:
        """Stops `model_id`'s worker, if any, and starts one for `request`; the other models'
        workers run on, whether this load succeeds or not. With `keep_serving` the old worker
        serves while the new one loads (make before break), on if the new one fails, and once
        it is ready until the coordinator unloads it (`kept`)."""
        keep = request.keep_serving
        with self._workers_lock:
            old = self.workers.get(model_id) if keep else self.workers.pop(model_id, None)
        if not keep:  # a recovery: the previous plans' workers make room
            for process in [*([old.process] if old is not None else []),
                            *self.kept.take_model(model_id)]:
                process.stop(timeout=REPLACE_GRACE_SECONDS)
        self.status = f"loading {request.model_path}"
        # The model's own mode wins over the node's engine flag.
        engine = (replace(self.engine, speculative=request.speculative) if request.speculative
                  else self.engine)
        world = max(1, request.world_size)
        config = WorkerConfig(
            model_path=Path(request.model_path), model_id=model_id,
            layer_start=request.layer_start, layer_end=request.layer_end or None,
            streamed_layers=request.streamed_layers, rank=request.rank,
            peers=tuple(request.peers) if world > 1 else (),
            backend=request.backend or "ring", tensor=world > 1 and request.tensor,
            stage_ranks=tuple(request.stage_ranks) if world > 1 else (),
            rdma_devices=request.rdma_devices_json if world > 1 else "",
            plan_hash=request.plan_hash, micro_batches=request.micro_batches, host=self.host,
            node_id=self.node_id, metrics_port=self._free_metrics_port(),
            kind=request.kind or "chat", load_reason=request.load_reason, engine=engine)
        # Its callers must present the same session, over TLS with these credentials.
        env = {auth.SESSION_ENV: self.session} if self.session else {}
        if self.tls is not None:
            env.update(self.tls.to_env())
        job = WorkerJob(config, env)
        process = self._take_standby(load_nice(request.load_reason))
        what = f"the shard worker of {model_id} (rank {request.rank})"
        if process is not None:
            process.rename(what)
            process.send_line(job.to_json())
        else:
            process = start_worker(job, what, self.engine.log_level)
        try:
            info = process.wait_ready(WORKER_READY_TIMEOUT_SECONDS, abandoned)
        except ChildError as e:
            self.status = f"load failed: {e}"
            raise
        finally:
            # The next plan's group gets a fresh port: the last one may linger in TIME_WAIT,
            # or be this worker's for as long as it runs.
            self.data_port = free_port(self.host)
            self._spawn_standby()
        worker = Worker(process, request, pb.LoadShardReply(
            model_id=model_id, layer_start=info["layer_start"], layer_end=info["layer_end"],
            num_layers=info["num_layers"], dtype=info["dtype"],
            load_seconds=info["load_seconds"], worker_pid=info["pid"],
            load_nice=info.get("load_nice", 0),
            worker_address=f"{self.host}:{info['port']}" if info["port"] else ""),
            info.get("metrics_port") or 0)
        worker.probe(self.host)  # the first Health after LoadShard already shows its memory
        with self._workers_lock:
            self.workers.pop(model_id, None)  # (kept serving until now) moves last
            self.workers[model_id] = worker
        if old is not None and keep:
            for process in self.kept.keep(model_id, old.reply.worker_pid, old.process,
                                          old.metrics_port, request.keep_serving_seconds):
                process.stop(timeout=REPLACE_GRACE_SECONDS)
        self.status = "no shard loaded"  # for when every worker is unloaded again
        log.info("worker %d serves layers [%d, %d) of %s as rank %d of %d", info["pid"],
                 info["layer_start"], info["layer_end"], model_id, request.rank, world)
        return worker.reply

    def _free_metrics_port(self) -> int:
        """The agent's --metrics-port unless a running worker holds it; then 0 (any port)."""
        with self._workers_lock:
            taken = any(w.metrics_port == self.metrics_port and w.process.alive()
                        for w in self.workers.values())
        return 0 if taken or self.kept.holds_port(self.metrics_port) else self.metrics_port

    def _set_loading(self, loading: bool) -> None:
        with self._workers_lock:
            self._loading = loading
            self._keep_awake()

    def _keep_awake(self) -> None:
        """The power assertion holds while any worker is loaded or loading (called with
        _workers_lock held, after either changed)."""
        if self._loading or self.workers:
            self.awake.hold()
        else:
            self.awake.release()

    def unload(self, model_id: str, grace: float = UNLOAD_GRACE_SECONDS,
               worker_pid: int = 0) -> pb.UnloadShardReply:
        """Stops `model_id`'s worker (SIGTERM, SIGKILL after `grace` seconds), and any kept
        serving after a move, and returns once they have exited, so their memory is free;
        `worker_pid`: only the one of that pid, kept or serving. It does not wait for a load in
        flight: a model whose load is in flight has no worker here yet."""
        with self._workers_lock:
            worker = self.workers.get(model_id)
            if worker is not None and worker_pid in (0, worker.reply.worker_pid):
                del self.workers[model_id]
            else:
                worker = None
        processes = [worker.process] if worker is not None else []
        if worker_pid:
            processes += [p] if (p := self.kept.take(worker_pid)) is not None else []
        else:
            processes += self.kept.take_model(model_id)
        if not processes:
            return pb.UnloadShardReply(was_loaded=False)
        t0 = time.monotonic()
        killed = any([stop_process(p, grace) for p in processes])
        seconds = time.monotonic() - t0
        with self._workers_lock:
            self._keep_awake()
        log.info("unloaded %s: worker(s) %s %s after %.1fs", model_id,
                 ", ".join(str(p.pid) for p in processes), "killed" if killed else "exited",
                 seconds)
        return pb.UnloadShardReply(was_loaded=True, killed=killed, seconds=seconds)

    def _spawn_standby(self) -> None:
        """Starts the next plan's worker now, up to where it waits for its plan: importing MLX
        and mlx-lm takes seconds, which a re-plan after a failure should not wait for."""
        if self.standby and (self._standby is None or not self._standby.alive()):
            self._standby = worker_process("a standby shard worker", self.engine.log_level,
                                           standby=True)

    def _take_standby(self, nice: int) -> ChildProcess | None:
        """The standby worker for a load at `nice`, or None: start a fresh one. A standby
        still importing at a lower priority than the load's stays the next load's: a fresh
        worker imports at its own priority sooner than that one would behind busy workers."""
        worker, self._standby = self._standby, None
        if worker is None or not worker.alive():
            return None
        if nice < import_nice() and not imported(worker.ready_file):
            log.info("the standby worker is still importing at nice %d: a load at nice %d "
                     "starts a fresh one", import_nice(), nice)
            self._standby = worker
            return None
        return worker

    def _stop_workers(self) -> None:
        with self._workers_lock:
            workers, self.workers = list(self.workers.values()), {}
        processes = [w.process for w in workers] + self.kept.take_all()
        for p in processes:  # all at once: each flushes its prefix cache meanwhile
            if p.alive():
                p.proc.terminate()
        for p in processes:
            p.stop(timeout=REPLACE_GRACE_SECONDS)

    def _probe_workers(self) -> None:
        """Keeps Health's view of each worker's memory fresh, so that Health never waits on a
        busy worker's /metrics or a large process's page tables."""
        while not self._shutdown.wait(PROBE_SECONDS):
            with self._workers_lock:
                workers = list(self.workers.values())
            for w in workers:
                w.probe(self.host)

    def _unload_orphans(self) -> None:
        """Stops every worker once no coordinator has called for `orphan_grace` seconds: one
        that never comes back must not leave this Mac holding a model's memory. The agent
        stays, so a coordinator that does come back finds the node and loads it again."""
        while not self._shutdown.wait(ORPHAN_CHECK_SECONDS):
            silent = time.monotonic() - self._heard
            if silent < self.orphan_grace or not self.workers:
                continue
            if not self._lock.acquire(blocking=False):  # a load in flight: a coordinator is here
                continue
            try:
                log.warning("no coordinator has called for %.0f s (--orphan-grace): unloading "
                            "%s to free this Mac's memory", silent, ", ".join(self.workers))
                self._stop_workers()
                with self._workers_lock:
                    self._keep_awake()
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        self._shutdown.set()

    def serve_forever(self, watch: bool = False) -> None:
        """Serves until SIGTERM/SIGINT, `shutdown`, or (with `watch`) the parent's exit."""
        on_stop_signals(self.shutdown)
        if watch:
            watch_parent(self.shutdown)
        self.server.start()
        with self._lock:
            self._spawn_standby()
        threading.Thread(target=self._probe_workers, name="probe-workers", daemon=True).start()
        if self.orphan_grace > 0:
            threading.Thread(target=self._unload_orphans, name="orphans", daemon=True).start()
        freeze_startup_heap()
        log.info("node agent listening on %s:%d (%s; data plane port %d)", self.host, self.port,
                 "mutual TLS under the cluster secret" if self.tls else "no TLS", self.data_port)
        while not self._shutdown.wait(0.5):  # a bare wait() would not let signal handlers run
            pass
        self.server.stop(grace=2).wait(5)
        with self._lock:
            self._stop_workers()
            self.awake.release()
            if self._standby is not None:
                self._standby.stop(timeout=1.0)
