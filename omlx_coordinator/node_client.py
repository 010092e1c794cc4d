"""Async gRPC clients of a node agent and of a shard worker (proto/omlx.proto)."""

from __future__ import annotations

import grpc

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

LOAD_TIMEOUT_SECONDS = 1800.0


class AgentClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.NodeAgentStub(self.channel)

    async def load_shard(self, request: pb.LoadShardRequest) -> pb.LoadShardReply:
        return await self.stub.LoadShard(request, timeout=LOAD_TIMEOUT_SECONDS,
                                         wait_for_ready=True)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class WorkerClient:
    """The head worker of a plan: where sequences go."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.ShardWorkerStub(self.channel)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout)

    async def stats(self, timeout: float = 2.0) -> pb.StatsReply:
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout)

    def generate(self, request: pb.GenerateRequest, timeout: float):
        """A server-streaming call: iterate it for TokenChunks; `.cancel()` frees the sequence."""
        return self.stub.Generate(request, timeout=timeout)

    async def cancel(self, request_id: str) -> None:
        await self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=2.0)

    async def close(self) -> None:
        await self.channel.close()
