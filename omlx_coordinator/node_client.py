"""Async gRPC client of one node agent (proto/omlx.proto)."""

from __future__ import annotations

import grpc

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

LOAD_TIMEOUT_SECONDS = 1800.0


class NodeClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.NodeStub(self.channel)

    async def load_shard(
        self, model_path: str, model_id: str, layer_start: int = 0, layer_end: int = 0
    ) -> pb.LoadShardReply:
        req = pb.LoadShardRequest(
            model_path=model_path, model_id=model_id, layer_start=layer_start, layer_end=layer_end
        )
        return await self.stub.LoadShard(req, timeout=LOAD_TIMEOUT_SECONDS, wait_for_ready=True)

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
