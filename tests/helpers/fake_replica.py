"""A replica's head worker played by a script, for the request path's tests without processes:
each sequence sent to it gets the next scripted attempt, whose steps are TokenChunks, gRPC errors
(what a real session call delivers, omlx_coordinator/nodes/worker_session.py), pauses (seconds) and
hooks (callables: a re-plan, a drain) run at that point of the stream."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from pathlib import Path

import grpc

from omlx_coordinator.models.deployment import Deployment
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.model_config import ModelConfig
from omlx_coordinator.models.served_model import LOADED, ServedModel
from omlx_coordinator.nodes.cluster import Cluster, ClusterOptions
from omlx_coordinator.nodes.worker_session import rpc_error
from proto import omlx_pb2 as pb

Step = pb.TokenChunk | grpc.aio.AioRpcError | float | Callable[[], object]


def chunk(*tokens: int, finish: str = "", error: str = "", cached: int = 0) -> pb.TokenChunk:
    return pb.TokenChunk(tokens=tokens, finish_reason=finish, error=error, cached_tokens=cached)


def broken(details: str = "the worker went away") -> grpc.aio.AioRpcError:
    """What a session call delivers when its worker dies under it."""
    return rpc_error(grpc.StatusCode.UNAVAILABLE, details)


def aborted() -> pb.TokenChunk:
    """A worker stopped cleanly for a new plan."""
    return chunk(finish="aborted", error="the node is shutting down")


class FakeCall:
    """One sequence: a session call's queue of items, fed from its script."""

    def __init__(self, steps: list[Step]):
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.feeder = asyncio.create_task(self._feed(steps))

    async def _feed(self, steps: list[Step]) -> None:
        for step in steps:
            if self.cancelled:
                return
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif callable(step):
                step()
            else:
                self.items.put_nowait(step)
            await asyncio.sleep(0)  # one step a turn of the loop, as a stream's messages come

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWorker:
    """A head worker: `generate` plays the next scripted attempt; `requests` are what it got."""

    def __init__(self, *attempts: list[Step]):
        self.script = deque(attempts)
        self.requests: list[pb.GenerateRequest] = []
        self.calls: list[FakeCall] = []

    def generate(self, request: pb.GenerateRequest, timeout: float) -> FakeCall:
        assert self.script, f"no attempt scripted for request {len(self.requests) + 1}"
        self.requests.append(request)
        self.calls.append(FakeCall(self.script.popleft()))
        return self.calls[-1]


def fake_manager(model_path: Path, block_size: int = 4) -> ModelManager:
    """A model manager of the model at `model_path`, marked loaded, over a cluster of no
    nodes: its replicas serve only once a test gives them a FakeWorker (`serve`)."""
    model = ServedModel(ModelConfig("fake", str(model_path)), model_path)
    manager = ModelManager(Cluster(ClusterOptions()), [model], block_size=block_size)
    model.state = LOADED
    manager.started = True
    return manager


def add_replica(manager: ModelManager) -> Deployment:
    """Another replica of the manager's model (not serving yet)."""
    model = manager.models[0]
    ds = manager.replicas[model.name]
    ds.append(manager.new_deployment(model, replica=len(ds)))
    return ds[-1]


def serve(d: Deployment, worker: FakeWorker) -> Callable[[], None]:
    """Makes `d` serve on `worker` (a new epoch); returns a hook that does it again: a re-plan
    onto the same worker."""
    def replan() -> None:
        d.node = worker
        d.serving()

    replan()
    return replan


class CachingWorker(FakeWorker):
    """A head worker that answers each sequence with the next of `answers` (token ids, ending
    with `finish`) and reports as cached the longest start its prompt shares with a sequence run
    before (its prompt and answer): a node's prefix cache that holds every token it was sent or
    generated, at token granularity."""

    def __init__(self, *answers: list[int], finish: str = "stop"):
        super().__init__()
        self.answers, self.finish = deque(answers), finish
        self.held: list[list[int]] = []

    def generate(self, request: pb.GenerateRequest, timeout: float) -> FakeCall:
        assert self.answers, f"no answer scripted for request {len(self.requests) + 1}"
        prompt, answer = list(request.prompt_tokens), self.answers.popleft()
        cached = max((shared_start(prompt, h) for h in self.held), default=0)
        self.held.append(prompt + answer)
        self.script.append([chunk(*answer, finish=self.finish,
                                  cached=min(cached, len(prompt) - 1))])
        return super().generate(request, timeout)


def shared_start(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
