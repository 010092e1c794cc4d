"""The shard worker of an embedding, reranking or speech-to-text model: the whole model on one
node, serving Encode or Transcribe (proto/omlx.proto) instead of Session.

These models are small and answer in one forward pass per batch, so there is no pipeline, no
KV cache and no continuous batcher. The calls run on the main thread (MLX's streams belong to
the thread that made them; the handlers queue their calls there and wait, each bounded by its
gRPC deadline). Encode calls that queued while a pass ran are merged into one `Encoder.run`
(at most MAX_BATCH_INPUTS inputs): their inputs share the forward passes
omlx_node/encoders.py cuts by length, and each call gets its own rows back. Many clients
sending an input or a few each then cost a few passes, not a pass each. Transcribe calls run
one at a time. The worker runs at nice 10 (omlx_node/load_priority.py): below a chat model's
decode on the same node.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from omlx_node.encoders import Encoder
from omlx_node.load_priority import (at_low_priority, encode_nice, load_nice,
                                     lower_this_process, reason_name, thread_nice)
from omlx_node.transcriber import Transcriber
from omlx_shared import __version__, auth, cluster_tls
from omlx_shared.child import on_stop_signals, write_ready
from omlx_shared.heap import freeze_startup_heap
from omlx_shared.model_kinds import TRANSCRIBE, kind_of
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_CALLS = 64
MAX_BATCH_INPUTS = 1024  # inputs of the Encode calls merged into one run
POLL_SECONDS = 0.5  # how often a waiting handler checks that its caller is still there


class _Job:
    """A call's work, run on the main thread: `run()`'s result, or the ValueError it raised."""

    def __init__(self, run: Callable[[], object]):
        self.run = run
        self.done = threading.Event()
        self.result = None
        self.error: ValueError | None = None
        self.cancelled = False


class _Encode(_Job):
    """An Encode call's inputs (and token type ids: [] for none), merged with the calls queued
    beside it."""

    def __init__(self, inputs: list[list[int]], types: list[list[int]]):
        super().__init__(lambda: None)
        self.inputs, self.types = inputs, types


class EncoderService(pb_grpc.ShardWorkerServicer):
    def __init__(self, model: Encoder | Transcriber, model_id: str):
        self.model, self.model_id = model, model_id
        self.session = os.environ.get(auth.SESSION_ENV)
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.stopping = False  # set by `stop`, from the stop-signal thread

    def serve(self) -> None:
        """Runs the queued calls on this (the main) thread until `stop`."""
        carry: _Job | None = None  # taken off the queue but left out of the last batch
        while not self.stopping:
            job, carry = carry, None
            if job is None:
                try:
                    job = self.jobs.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
            if job.cancelled:
                continue
            if isinstance(job, _Encode):
                batch, carry = self._gather(job)
                self._encode(batch)
                continue
            try:
                job.result = job.run()
            except ValueError as e:
                job.error = e
            job.done.set()

    def _gather(self, first: _Encode) -> tuple[list[_Encode], _Job | None]:
        """`first` and the Encode calls queued behind it, up to MAX_BATCH_INPUTS inputs; and
        the call taken off the queue that did not fit, if any."""
        batch, inputs = [first], len(first.inputs)
        for _ in range(MAX_CALLS):  # no more calls than that are ever queued
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job.cancelled:
                continue
            if not isinstance(job, _Encode) or inputs + len(job.inputs) > MAX_BATCH_INPUTS:
                return batch, job
            batch.append(job)
            inputs += len(job.inputs)
        return batch, None

    def _encode(self, batch: list[_Encode]) -> None:
        """The calls' inputs through one `Encoder.run`, each call's rows split back; a call the
        model refuses (an input too long) gets its ValueError without holding up the rest."""
        good = []
        for job in batch:
            try:
                self.model.check(job.inputs)
                good.append(job)
            except ValueError as e:
                job.error = e
        if good:
            types = None
            if any(any(job.types) for job in good):
                types = [t for job in good for t in job.types]
            rows = self.model.run([x for job in good for x in job.inputs], types)
            start = 0
            for job in good:
                job.result = rows[start:start + len(job.inputs)]
                start += len(job.inputs)
        for job in batch:
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
        if not isinstance(self.model, Encoder):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{self.model_id} is a speech-to-text model: it does not encode")
        if not inputs or any(not x for x in inputs):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "every input needs one token or more")
        rows = self._wait(_Encode(inputs, types), context)
        return pb.EncodeReply(dim=rows.shape[1], values=rows.reshape(-1).tolist())

    def Transcribe(self, request: pb.TranscribeRequest, context: grpc.ServicerContext):
        self._authorize(context)
        if not isinstance(self.model, Transcriber):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{self.model_id} is not a speech-to-text model")
        r = request
        t = self._wait(_Job(lambda: self.model.run(
            r.audio, r.filename, r.language, r.prompt,
            r.temperature if r.has_temperature else None, r.word_timestamps)), context)
        return pb.TranscribeReply(text=t.text, language=t.language, duration=t.duration, segments=[
            pb.TranscriptSegment(
                id=i, seek=int(s.get("seek", 0)), start=s["start"], end=s["end"],
                text=s["text"], tokens=s.get("tokens", []),
                temperature=s.get("temperature") or 0.0, avg_logprob=s.get("avg_logprob", 0.0),
                compression_ratio=s.get("compression_ratio", 0.0),
                no_speech_prob=s.get("no_speech_prob", 0.0),
                words=[pb.TranscriptWord(word=w["word"], start=w["start"], end=w["end"])
                       for w in s.get("words") or ()])
            for i, s in enumerate(t.segments)])

    def _wait(self, job: _Job, context: grpc.ServicerContext):
        """`job` run on the main thread, once the calls before it are done; the call's
        INVALID_ARGUMENT when it raised ValueError."""
        self.jobs.put(job)
        while not job.done.wait(POLL_SECONDS):
            if not context.is_active():  # its caller gave up (or its deadline passed)
                job.cancelled = True
                context.abort(grpc.StatusCode.CANCELLED, "the call ended before its turn")
        if job.error is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(job.error))
        return job.result

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext):
        self._authorize(context)
        return pb.HealthReply(ready=True, model_id=self.model_id, status="ready",
                              version=__version__, layer_start=0, layer_end=1, num_layers=1,
                              pid=os.getpid(), worker_pid=os.getpid(), world_size=1)


def start_server(service: EncoderService, host: str) -> tuple[grpc.Server, int]:
    """The gRPC server of `service` on `host` (the cluster's TLS where its secret is in the
    environment), started; and its port. Its calls run once `service.serve()` does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_CALLS),
                         maximum_concurrent_rpcs=MAX_CALLS)
    pb_grpc.add_ShardWorkerServicer_to_server(service, server)
    port = cluster_tls.add_port(server, f"{host}:0", cluster_tls.Credentials.from_env())
    server.start()
    return server, port


def run_encoder_worker(model_path: Path, model_id: str, kind: str, host: str,
                       ready_file: Path | None, load_reason: int = pb.LOAD_REQUESTED) -> int:
    """Loads the model (at the priority `load_reason`, a pb.LoadReason, sets), serves Encode
    until SIGTERM; returns the exit code."""
    lower_this_process(encode_nice())  # below a chat model's decode, its BLAS threads too
    t0 = time.monotonic()
    nice = load_nice(load_reason)
    log.info("loading %s at nice %d (%s)", model_id, nice, reason_name(load_reason))
    niced: list[int] = []  # as the loading thread reads it

    def load() -> Encoder | Transcriber:
        niced.append(thread_nice())
        return (Transcriber(model_path) if kind == TRANSCRIBE
                else Encoder(model_path, kind_of(model_path, kind)))

    model = at_low_priority(load, nice=nice)
    load_seconds = time.monotonic() - t0
    log.info("%s (%s) loaded in %.1fs", model_id, kind, load_seconds)
    freeze_startup_heap()
    service = EncoderService(model, model_id)
    server, port = start_server(service, host)
    on_stop_signals(service.stop)
    if ready_file:
        dtype = model.dtype if isinstance(model, Encoder) else "float32"
        write_ready(ready_file, {"pid": os.getpid(), "dtype": dtype,
                                 "load_seconds": load_seconds, "layer_start": 0,
                                 "layer_end": 1, "num_layers": 1, "port": port,
                                 "metrics_port": 0, "load_nice": niced[0]})
    service.serve()
    server.stop(grace=2).wait(5)
    return 0
