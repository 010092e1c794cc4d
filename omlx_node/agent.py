"""Node agent: the long-lived process of one node. It serves the NodeAgent gRPC service and owns
the node's shard worker process, replacing it on every new plan. The agent never runs MLX, so it
survives whatever happens to a worker.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
from concurrent import futures

import grpc

from omlx_node.stay_awake import StayAwake
from omlx_node.thunderbolt import rdma_ports
from omlx_node.weight_store import WeightError, WeightStore
from omlx_shared import __version__, auth, checks, cluster_tls, hardware
from omlx_shared.blas import blas_env
from omlx_shared.child import ChildError, ChildProcess, omlx_command, watch_parent
from omlx_shared.node_identity import default_node_id
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_SECONDS = 1800.0  # joining the group and loading a large shard
PENDING_HANDSHAKES = 16  # begun and not yet admitted; older ones are dropped
NONCES_REMEMBERED = 4096  # coordinator nonces seen: a replayed Handshake is refused


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NodeAgent(pb_grpc.NodeAgentServicer):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, data_port: int = 0,
                 metrics_port: int = 0, engine_args: list[str] | None = None,
                 secret: str | None = None, node_id: str = "", chip: str = "",
                 speed: float = 0.0, standby: bool = True):
        self.secret = secret
        self.node_id = node_id or default_node_id()
        self.chip = chip or hardware.chip()
        self.speed = speed
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
        self.metrics_port = metrics_port  # every worker exports /metrics there (0: any port)
        self.worker_metrics_port = 0  # the port the worker bound
        self.engine_args = list(engine_args or [])  # passed on to every worker
        self.worker: ChildProcess | None = None
        self.reply: pb.LoadShardReply | None = None
        self.request: pb.LoadShardRequest | None = None
        self.status = "no shard loaded"
        self.awake = StayAwake()  # a power assertion against idle sleep while a shard is loaded
        self.checks: list[pb.NodeCheck] = []  # doctor's checks of this machine, once they ran
        threading.Thread(target=self._check_machine, name="checks", daemon=True).start()
        self.weights = WeightStore()  # layers received from the coordinator
        self._lock = threading.Lock()  # one plan change at a time
        self._shutdown = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_NodeAgentServicer_to_server(self, self.server)
        self.port = cluster_tls.add_port(self.server, f"{host}:{port}", self.tls)
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port} (address in use?)")

    # ---- gRPC ------------------------------------------------------------------------------

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext):
        if not auth.compatible(request.version, __version__):
            log.warning("refused coordinator %s: it runs omlx-cluster %s, this node %s",
                        context.peer(), request.version, __version__)
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
            rdma_ports=self.rdma_ports)

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
        if self.secret is None:
            return
        if self.session is None or not auth.check(self.session.encode(),
                                                  auth.presented(context).encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "not admitted: the coordinator must handshake with the cluster secret")

    def LoadShard(self, request: pb.LoadShardRequest, context: grpc.ServicerContext):
        self._authorize(context)
        try:
            return self.load(request)
        except (ChildError, ValueError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

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
        w, r = self.worker, self.reply
        ready = w is not None and w.alive() and r is not None
        reply = pb.HealthReply(ready=ready, status=self.status if ready or w is None else
                               "the shard worker exited", version=__version__, pid=os.getpid(),
                               data_port=self.data_port,
                               metrics_port=self.worker_metrics_port, checks=self.checks)
        if r is not None and self.request is not None:
            reply.model_id = r.model_id
            reply.layer_start, reply.layer_end, reply.num_layers = (
                r.layer_start, r.layer_end, r.num_layers)
            reply.worker_pid = r.worker_pid
            reply.rank, reply.world_size = self.request.rank, max(1, self.request.world_size)
        return reply

    def _check_machine(self) -> None:
        """`omlx-cluster doctor`'s checks of this machine, once (system_profiler takes seconds):
        logged, and carried by every Health reply to `omlx-cluster status`."""
        results = checks.local_checks()
        checks.log_problems(results, log)
        self.checks = [pb.NodeCheck(**r.to_dict()) for r in results]

    # ---- plans -----------------------------------------------------------------------------

    def load(self, request: pb.LoadShardRequest) -> pb.LoadShardReply:
        """Replaces the worker with one for `request`'s plan; returns once it can serve."""
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
        with self._lock:
            self._stop_worker()
            self.awake.hold()
            self.status = f"loading {request.model_path}"
            argv = ["--model", request.model_path,
                    "--model-id", request.model_id or os.path.basename(request.model_path),
                    "--layers", f"{request.layer_start}:{request.layer_end or ''}",
                    "--rank", str(request.rank), "--host", self.host,
                    "--plan-hash", request.plan_hash,
                    "--micro-batches", str(request.micro_batches),
                    "--node-id", self.node_id, "--metrics-port", str(self.metrics_port)]
            if world > 1:
                argv += ["--peers", ",".join(request.peers), "--backend", backend]
            if world > 1 and backend == "jaccl":
                argv += ["--rdma-devices", request.rdma_devices_json]
            # Its callers must present the same session, over TLS with these credentials.
            env = {auth.SESSION_ENV: self.session} if self.session else {}
            if self.tls is not None:
                env.update(self.tls.to_env())
            worker = self._take_standby()
            what = f"the shard worker (rank {request.rank})"
            if worker is not None:
                worker.what = what
                worker.send_line(json.dumps({"argv": argv, "env": env}))
            else:
                worker = ChildProcess(omlx_command("worker", *argv, *self.engine_args), what,
                                      env=blas_env({**os.environ, **env}))
            try:
                info = worker.wait_ready(WORKER_READY_TIMEOUT_SECONDS)
            except ChildError as e:
                self.status = f"load failed: {e}"
                self.awake.release()  # nothing is loaded now
                raise
            finally:
                # The next plan's group gets a fresh port: the last one may linger in TIME_WAIT.
                self.data_port = free_port(self.host)
                self._spawn_standby()
            self.worker, self.request = worker, request
            self.worker_metrics_port = info.get("metrics_port") or 0
            self.reply = pb.LoadShardReply(
                model_id=request.model_id or os.path.basename(request.model_path),
                layer_start=info["layer_start"], layer_end=info["layer_end"],
                num_layers=info["num_layers"], dtype=info["dtype"],
                load_seconds=info["load_seconds"], worker_pid=info["pid"],
                worker_address=f"{self.host}:{info['port']}" if info["port"] else "")
            self.status = "ready"
            log.info("worker %d serves layers [%d, %d) as rank %d of %d", info["pid"],
                     info["layer_start"], info["layer_end"], request.rank, world)
            return self.reply

    def _spawn_standby(self) -> None:
        """Starts the next plan's worker now, up to where it waits for its plan: importing MLX
        and mlx-lm takes seconds, which a re-plan after a failure should not wait for."""
        if self.standby and (self._standby is None or not self._standby.alive()):
            # Its BLAS is chosen now: a library is preloaded when a process starts.
            self._standby = ChildProcess(omlx_command("worker", "--standby", *self.engine_args),
                                         "a standby shard worker", env=blas_env(),
                                         stdin_pipe=True)

    def _take_standby(self) -> ChildProcess | None:
        worker, self._standby = self._standby, None
        return worker if worker is not None and worker.alive() else None

    def _stop_worker(self) -> None:
        if self.worker is not None:
            # A stage blocked on a dead peer cannot run its SIGTERM handler: do not wait long
            # (a healthy one flushes its prefix cache and exits well within this).
            self.worker.stop(timeout=1.0)
        self.worker = self.reply = self.request = None

    def shutdown(self) -> None:
        self._shutdown.set()

    def serve_forever(self, watch: bool = False) -> None:
        """Serves until SIGTERM/SIGINT, `shutdown`, or (with `watch`) the parent's exit."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.shutdown())
        if watch:
            watch_parent(self.shutdown)
        self.server.start()
        with self._lock:
            self._spawn_standby()
        log.info("node agent listening on %s:%d (%s; data plane port %d)", self.host, self.port,
                 "mutual TLS under the cluster secret" if self.tls else "no TLS", self.data_port)
        while not self._shutdown.wait(0.5):  # a bare wait() would not let signal handlers run
            pass
        self.server.stop(grace=2).wait(5)
        with self._lock:
            self._stop_worker()
            self.awake.release()
            if self._standby is not None:
                self._standby.stop(timeout=1.0)
