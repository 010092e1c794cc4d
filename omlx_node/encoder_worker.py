"""The shard worker of an embedding or reranking model: the whole model on one node, serving
Encode (proto/omlx.proto) instead of Generate.

These models are small and answer in one forward pass per batch, so there is no pipeline, no
KV cache and no continuous batcher: each call's inputs run as the forward passes
omlx_node/encoders.py cuts them into, one call at a time, on the main thread (MLX's streams
belong to the thread that made them; the handlers queue their calls there and wait, each bounded
by its gRPC deadline).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from omlx_node.encoders import Encoder
from omlx_shared import __version__, auth, cluster_tls
from omlx_shared.child import write_ready
from omlx_shared.heap import freeze_startup_heap
from omlx_shared.model_kinds import detect_kind
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_CALLS = 64
POLL_SECONDS = 0.5  # how often a waiting handler checks that its caller is still there


class _Job:
    def __init__(self, inputs: list[list[int]], types: list[list[int]] | None):
        self.inputs, self.types = inputs, types
        self.done = threading.Event()
        self.rows = None
        self.error: ValueError | None = None
        self.cancelled = False


class EncoderService(pb_grpc.ShardWorkerServicer):
    def __init__(self, encoder: Encoder, model_id: str):
        self.encoder, self.model_id = encoder, model_id
        self.session = os.environ.get(auth.SESSION_ENV)
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.requests = self.tokens = 0
        self.stopping = False  # set by a signal handler: a plain flag takes no lock

    def serve(self) -> None:
        """Runs the queued calls on this (the main) thread until `stop`."""
        while not self.stopping:
            try:
                job = self.jobs.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if job.cancelled:
                continue
            try:
                job.rows = self.encoder.run(job.inputs, job.types)
            except ValueError as e:
                job.error = e
            self.requests += 1
            self.tokens += sum(len(x) for x in job.inputs)
            job.done.set()

    def stop(self) -> None:
        self.stopping = True

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.session is not None and not auth.check(
                self.session.encode(), auth.presented(context).encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "not admitted: calls to a shard worker need the cluster session")

    def Encode(self, request: pb.EncodeRequest, context: grpc.ServicerContext):
        self._authorize(context)
        inputs = [list(x.tokens) for x in request.inputs]
        types = [list(x.type_ids) for x in request.inputs]
        if not inputs or any(not x for x in inputs):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "every input needs one token or more")
        job = _Job(inputs, types if any(types) else None)
        self.jobs.put(job)
        while not job.done.wait(POLL_SECONDS):
            if not context.is_active():  # its caller gave up (or its deadline passed)
                job.cancelled = True
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before its turn")
        if job.error is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(job.error))
        return pb.EncodeReply(dim=job.rows.shape[1], values=job.rows.reshape(-1).tolist())

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext):
        self._authorize(context)
        return pb.HealthReply(ready=True, model_id=self.model_id, status="ready",
                              version=__version__, layer_start=0, layer_end=1, num_layers=1,
                              pid=os.getpid(), worker_pid=os.getpid(), world_size=1)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext):
        self._authorize(context)
        return pb.StatsReply(requests_total=self.requests, prompt_tokens_total=self.tokens)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{self.model_id} is an embedding or reranking model: it does not generate")


def run_encoder_worker(model_path: Path, model_id: str, kind: str, host: str,
                       ready_file: Path | None) -> int:
    """Loads the model, serves Encode until SIGTERM; returns the exit code."""
    t0 = time.monotonic()
    detected = detect_kind(model_path)
    if detected.kind != kind:
        raise SystemExit(f"error: {model_path} is a {detected.kind} model, asked to load as "
                         f"{kind}")
    encoder = Encoder(model_path, detected)
    load_seconds = time.monotonic() - t0
    log.info("%s (%s) loaded in %.1fs: %.1f MB", model_id, kind, load_seconds,
             encoder.nbytes() / 1e6)
    freeze_startup_heap()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_CALLS),
                         maximum_concurrent_rpcs=MAX_CALLS)
    service = EncoderService(encoder, model_id)
    pb_grpc.add_ShardWorkerServicer_to_server(service, server)
    port = cluster_tls.add_port(server, f"{host}:0", cluster_tls.Credentials.from_env())
    server.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    if ready_file:
        write_ready(ready_file, {"pid": os.getpid(), "dtype": str(encoder.dtype),
                                 "load_seconds": load_seconds, "layer_start": 0,
                                 "layer_end": 1, "num_layers": 1, "port": port,
                                 "metrics_port": 0})
    service.serve()
    server.stop(grace=2).wait(5)
    return 0
