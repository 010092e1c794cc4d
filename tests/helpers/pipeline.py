"""Pipelines of shard worker processes driven over gRPC, one stub call at a time or
several at once."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.conftest import free_port
from tests.helpers.session import generate_chunks
from tests.helpers.workers import stage_worker


# Prompts of every kind a pipeline's greedy output is checked on: short, long, code, one char.
PROMPTS = [
    "The capital of France is",
    "Hello",
    "x",
    "def add(a, b):\n    return",
    "A pipeline splits the layers of a model across several machines. " * 5,
    "Numbers: 0 1 2 3",
    "Large language models predict",
    "How are you today?",
]


@contextmanager
def pipeline(model: Path, split: list[int], micro_batches: int = 0, init_timeout: float = 60,
             extra: tuple[str, ...] = (), ranks: int = 1,
             rank_flags: dict[int, tuple[str, ...]] | None = None):
    """Starts one shard worker per stage (its engine with `extra` flags, then a rank's own
    `rank_flags`), or `ranks` per stage where each is a tensor-parallel stage; yields the
    head's ShardWorker stub."""
    peers = tuple(f"127.0.0.1:{free_port()}" for _ in range(len(split) * ranks))
    bounds = [sum(split[:i]) for i in range(len(split) + 1)]
    tensor = {"stage_ranks": (ranks,) * len(split)} if ranks > 1 else {}
    workers = [stage_worker(model, r, (bounds[r // ranks], bounds[r // ranks + 1]), peers,
                            ("--prefill-chunk", "8", *extra, *(rank_flags or {}).get(r, ())),
                            micro_batches=micro_batches,
                            init_timeout=init_timeout, **tensor)
               for r in range(len(peers))]
    try:
        infos = [w.wait_ready(120) for w in workers]
        channel = grpc.insecure_channel(f"127.0.0.1:{infos[0]['port']}")
        yield pb_grpc.ShardWorkerStub(channel), workers
        channel.close()
    finally:
        for w in workers:
            w.stop()


@contextmanager
def tensor_stage(model: Path, ranks: int = 2, extra: tuple[str, ...] = ()):
    """Starts one shard worker per rank of a tensor-parallel stage (its engine with `extra`
    flags); yields rank 0's ShardWorker stub."""
    peers = tuple(f"127.0.0.1:{free_port()}" for _ in range(ranks))
    workers = [stage_worker(model, r, (0, None), peers, ("--prefill-chunk", "8", *extra),
                            tensor=True) for r in range(ranks)]
    try:
        infos = [w.wait_ready(120) for w in workers]
        channel = grpc.insecure_channel(f"127.0.0.1:{infos[0]['port']}")
        yield pb_grpc.ShardWorkerStub(channel), infos
        channel.close()
        for w in workers:  # a clean stop: rank 0's STOP ends every other rank
            w.stop()
            assert w.proc.returncode == 0, (w.proc.returncode, w.log_tail())
    finally:
        for w in workers:
            w.stop()


def generate(stub, ids: list[int], max_tokens: int = 20, rid: str = "") -> tuple[list[int], str]:
    chunks = generate_chunks(stub, pb.GenerateRequest(
        request_id=rid or str(time.monotonic_ns()), prompt_tokens=ids, max_tokens=max_tokens))
    return [t for c in chunks for t in c.tokens], chunks[-1].finish_reason


def run_concurrently(fn, items: list) -> list:
    results = [None] * len(items)

    def one(i):
        results[i] = fn(items[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results
