"""Node agent: the gRPC server of one node (proto/omlx.proto) in front of its stage and batcher.

gRPC handlers run on grpc's thread pool and never touch MLX: they hand requests to the engine
(the process's main thread, see `NodeAgent.serve_forever`) through the batcher's queue and read
each sequence's events back. A shard load is handed over the same way.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from omlx_cluster import __version__
from omlx_node.batcher import Batcher, Finish, SeqRequest
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.stage import StageRunner
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# A handler thread re-checks its client this often while its sequence waits in the queue.
POLL_SECONDS = 1.0
LOAD_TIMEOUT_SECONDS = 1800.0
# Every running stream holds one handler thread while it waits for tokens.
MAX_STREAMS = 512


@dataclass
class _LoadJob:
    request: pb.LoadShardRequest
    done: threading.Event = field(default_factory=threading.Event)
    reply: pb.LoadShardReply | None = None
    error: str = ""


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, agent: "NodeAgent"):
        self.agent = agent

    def LoadShard(self, request: pb.LoadShardRequest, context: grpc.ServicerContext):
        job = _LoadJob(request)
        self.agent.control.put(job)
        if not job.done.wait(LOAD_TIMEOUT_SECONDS):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "loading the shard timed out")
        if job.error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, job.error)
        return job.reply

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        batcher = self.agent.batcher
        if batcher is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this node has no shard loaded yet")
        s = request.sampling
        req = SeqRequest(
            request_id=request.request_id,
            prompt=list(request.prompt_tokens),
            max_tokens=request.max_tokens,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p if s.top_p > 0 else 1.0,
                top_k=s.top_k,
                min_p=s.min_p,
                seed=s.seed if s.has_seed else None,
            ),
            stop_token_ids=frozenset(request.stop_token_ids),
        )
        try:
            seq = batcher.submit(req)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Runs when the call ends for any reason, a client that went away included.
        context.add_callback(lambda: batcher.cancel(req.request_id))
        first = True
        while True:
            try:
                event = seq.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            tokens: list[int] = []
            while isinstance(event, int):
                tokens.append(event)
                try:
                    event = seq.events.get_nowait()
                except queue.Empty:
                    event = None
            chunk = pb.TokenChunk(tokens=tokens)
            if first:
                chunk.prompt_tokens = len(req.prompt)
                first = False
            if isinstance(event, Finish):
                chunk.finish_reason = event.reason
                chunk.error = event.error
            yield chunk
            if isinstance(event, Finish):
                return

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext):
        batcher = self.agent.batcher
        if batcher is not None:
            batcher.cancel(request.request_id)
        return pb.CancelReply(found=batcher is not None)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext):
        a = self.agent
        reply = pb.HealthReply(
            ready=a.batcher is not None,
            model_id=a.model_id,
            status=a.status,
            version=__version__,
            metrics_port=a.metrics_port,
            pid=os.getpid(),
        )
        if a.batcher is not None:
            info = a.batcher.stage.info
            reply.layer_start, reply.layer_end = info.layer_start, info.layer_end
            reply.num_layers = info.num_layers
        return reply

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext):
        b = self.agent.batcher
        if b is None:
            return pb.StatsReply()
        return pb.StatsReply(
            running=b.running,
            waiting=b.waiting,
            prompt_tokens_total=b.prompt_total,
            generated_tokens_total=b.generated_total,
            requests_total=b.requests_total,
            decode_tokens_per_second=b.decode_rate(),
        )


class NodeAgent:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        prefill_chunk: int = 512,
        max_batch: int = 64,
    ):
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.metrics = NodeMetrics()
        self.control: queue.Queue[_LoadJob] = queue.Queue()
        self.batcher: Batcher | None = None
        self.model_id = ""
        self.status = "no shard loaded"
        self._shutdown = threading.Event()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_STREAMS + 16),
            maximum_concurrent_rpcs=MAX_STREAMS,
        )
        pb_grpc.add_NodeServicer_to_server(NodeService(self), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port} (address in use?)")
        self.metrics_port = self.metrics.serve(host, metrics_port) if metrics_port is not None else 0

    def shutdown(self) -> None:
        self._shutdown.set()
        if self.batcher is not None:
            self.batcher.stop()

    def load(self, request: pb.LoadShardRequest) -> pb.LoadShardReply:
        """Replaces the current shard (engine thread only)."""
        if self.batcher is not None:
            self.batcher.stop()
            self.batcher.run()  # returns at once: fails what is in flight, releases the cache
            self.batcher = None
        self.status = f"loading {request.model_path}"
        end = request.layer_end or None
        stage = StageRunner(Path(request.model_path), request.layer_start, end)
        self.batcher = Batcher(stage, self.metrics, self.prefill_chunk, self.max_batch)
        self.model_id = request.model_id or Path(request.model_path).name
        self.status = "ready"
        info = stage.info
        self.metrics.load_seconds.set(info.load_seconds)
        self.metrics.shard_bytes.set(stage.nbytes())
        log.info(
            "loaded %s layers [%d, %d) of %d in %.1fs (%s)",
            self.model_id, info.layer_start, info.layer_end, info.num_layers,
            info.load_seconds, info.dtype,
        )
        return pb.LoadShardReply(
            model_id=self.model_id,
            layer_start=info.layer_start,
            layer_end=info.layer_end,
            num_layers=info.num_layers,
            dtype=info.dtype,
            load_seconds=info.load_seconds,
        )

    def _take_control(self, block: bool) -> None:
        try:
            job = self.control.get(timeout=0.5) if block else self.control.get_nowait()
        except queue.Empty:
            return
        try:
            job.reply = self.load(job.request)
        except Exception as e:
            log.exception("loading the shard failed")
            self.status = f"load failed: {e}"
            job.error = f"{type(e).__name__}: {e}"
        finally:
            job.done.set()

    def serve_forever(self, watch_parent: bool = False) -> None:
        """Runs the engine on the calling (main) thread until SIGTERM/SIGINT or `shutdown`."""
        parent = os.getppid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.shutdown())
        self.server.start()
        log.info("node agent listening on port %d", self.port)
        while not self._shutdown.is_set():
            if watch_parent and os.getppid() != parent:
                log.warning("parent process exited; shutting down")
                break
            self._take_control(block=self.batcher is None)
            if self.batcher is not None:
                self.batcher.step(block=True)
        if self.batcher is not None:
            self.batcher.stop()
            self.batcher.run()
        self.server.stop(grace=2).wait(5)
