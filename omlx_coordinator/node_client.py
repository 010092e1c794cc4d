"""Async gRPC clients of a node agent and of a shard worker (proto/omlx.proto)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from omlx_shared import __version__, auth
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

LOAD_TIMEOUT_SECONDS = 1800.0
# The node fingerprints its own copy of the model and checks its parts: reads of a few MB, but
# it may first wait for a broken transfer's handler to let go of the folder.
PREPARE_TIMEOUT_SECONDS = 120.0


class AdmissionError(RuntimeError):
    """A node that may not join: wrong secret, incompatible version. The message says which."""


class AgentClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.NodeAgentStub(self.channel)
        self.session = ""  # from `admit`; every later call carries it

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((auth.SESSION_METADATA, self.session),)

    async def admit(self, secret: str | None, timeout: float = 5.0) -> pb.HandshakeReply:
        """The two-way proof of the cluster secret (omlx_shared/auth.py); raises
        AdmissionError with the reason, logged on both sides."""
        c_nonce = auth.new_nonce()
        try:
            hello = await self.stub.Handshake(
                pb.HandshakeRequest(coordinator_nonce=c_nonce, version=__version__),
                timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise AdmissionError(f"node {self.address}: {e.details()}") from None
            raise
        if not auth.compatible(hello.version, __version__):
            raise AdmissionError(f"node {hello.node_id} ({self.address}) runs omlx-cluster "
                                 f"{hello.version}, this coordinator {__version__}")
        if secret is not None and not auth.check(
                auth.proof(secret, "node", c_nonce, hello.node_id), hello.proof):
            try:  # an empty proof: the node logs the refusal on its side too
                await self.stub.Admit(pb.AdmitRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                pass
            raise AdmissionError(f"node {hello.node_id} ({self.address}) does not hold this "
                                 "cluster's secret")
        admit_proof = auth.proof(secret, "coordinator", hello.node_nonce, c_nonce) if secret else b""
        try:
            await self.stub.Admit(pb.AdmitRequest(proof=admit_proof), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise AdmissionError(f"node {hello.node_id} ({self.address}) refused this "
                                     f"coordinator: {e.details()}") from None
            raise
        self.session = auth.session_token(secret, c_nonce, hello.node_nonce) if secret else ""
        return hello

    async def load_shard(self, request: pb.LoadShardRequest) -> pb.LoadShardReply:
        return await self.stub.LoadShard(request, timeout=LOAD_TIMEOUT_SECONDS,
                                         wait_for_ready=True, metadata=self.metadata)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout,
                                      metadata=self.metadata)

    async def prepare_weights(self, manifest: pb.WeightManifest,
                              timeout: float = PREPARE_TIMEOUT_SECONDS) -> pb.WeightNeeds:
        return await self.stub.PrepareWeights(manifest, timeout=timeout, metadata=self.metadata)

    def push_weights(self, chunks: AsyncIterator[pb.WeightChunk]):
        """A bidirectional stream: `read()` its WeightAcks; no deadline (a large range takes
        as long as it takes: omlx_coordinator/weight_transfer.py watches the acks instead)."""
        return self.stub.PushWeights(chunks, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()


class WorkerClient:
    """The head worker of a plan: where sequences go."""

    def __init__(self, address: str, session: str = ""):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.ShardWorkerStub(self.channel)
        self.metadata = ((auth.SESSION_METADATA, session),)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout,
                                      metadata=self.metadata)

    async def stats(self, timeout: float = 2.0) -> pb.StatsReply:
        return await self.stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata)

    def generate(self, request: pb.GenerateRequest, timeout: float):
        """A server-streaming call: iterate it for TokenChunks; `.cancel()` frees the sequence."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    async def cancel(self, request_id: str) -> None:
        await self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=2.0,
                               metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()
