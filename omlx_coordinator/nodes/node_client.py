"""Async gRPC clients of a node agent and of a shard worker (proto/omlx.proto)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from omlx_coordinator.nodes.worker_session import SessionCall, WorkerSession
from omlx_shared import __version__, auth, cluster_tls
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc

LOAD_TIMEOUT_SECONDS = 1800.0
# The node fingerprints its own copy of the model and checks its parts: reads of a few MB, but
# it may first wait for a broken transfer's handler to let go of the folder.
PREPARE_TIMEOUT_SECONDS = 120.0


class AdmissionError(RuntimeError):
    """A node that may not join: wrong secret, incompatible version. The message says which."""


class AgentClient:
    """The coordinator's connection to one node agent, named by its node id: with a secret the
    channel is mutual TLS (omlx_shared/cluster_tls.py) with a key pair of its own, and only a
    server holding a certificate for that node id answers on it."""

    def __init__(self, address: str, node_id: str, secret: str | None):
        self.address, self.node_id, self.secret = address, node_id, secret
        self.tls = cluster_tls.issue(secret, cluster_tls.COORDINATOR) if secret else None
        self.channel = cluster_tls.channel(address, self.tls, cluster_tls.node_identity(node_id))
        self.stub = pb_grpc.NodeAgentStub(self.channel)
        self.session = ""  # from `admit`; every later call carries it

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((auth.SESSION_METADATA, self.session),)

    async def admit(self, timeout: float = 5.0) -> pb.HandshakeReply:
        """The two-way proof of the cluster secret over this channel (omlx_shared/auth.py);
        raises AdmissionError with the reason, logged on both sides."""
        who = f"node {self.node_id} ({self.address})"
        c_nonce = auth.new_nonce()
        try:
            hello = await self.stub.Handshake(
                pb.HandshakeRequest(coordinator_nonce=c_nonce, version=__version__),
                timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise AdmissionError(f"{who}: {e.details()}") from None
            if refusal := cluster_tls.tls_refusal(e):
                raise AdmissionError(f"{who} does not hold this cluster's secret or is another "
                                     f"node: the TLS handshake failed ({refusal})") from None
            raise
        if not auth.compatible(hello.version, __version__):
            raise AdmissionError(f"{who} runs omlx-cluster {hello.version}, this coordinator "
                                 f"{__version__}")
        if hello.node_id != self.node_id:
            raise AdmissionError(f"{who} answers as node {hello.node_id!r}")
        transcript = auth.Transcript(c_nonce, hello.node_nonce, self.node_id,
                                     self.tls.fingerprint if self.tls else "")
        if self.secret is not None and not auth.check(transcript.proof(self.secret, "node"),
                                                      hello.proof):
            try:  # an empty proof: the node logs the refusal on its side too
                await self.stub.Admit(pb.AdmitRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                pass
            raise AdmissionError(f"{who}: its proof does not cover this connection (a relay "
                                 "or a replayed answer)")
        try:
            await self.stub.Admit(pb.AdmitRequest(
                proof=transcript.proof(self.secret, "coordinator") if self.secret else b""),
                timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                raise AdmissionError(f"{who} refused this coordinator: {e.details()}") from None
            raise
        self.session = transcript.session_token(self.secret) if self.secret else ""
        return hello

    def worker(self, address: str) -> WorkerClient:
        """The head worker this agent started: it serves with the agent's certificate and takes
        this admission's session, from this client's certificate only."""
        return WorkerClient(address, cluster_tls.channel(
            address, self.tls, cluster_tls.node_identity(self.node_id)), self.session)

    async def load_shard(self, request: pb.LoadShardRequest) -> pb.LoadShardReply:
        return await self.stub.LoadShard(request, timeout=LOAD_TIMEOUT_SECONDS,
                                         wait_for_ready=True, metadata=self.metadata)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout,
                                      metadata=self.metadata)

    async def probe_link(self, rank: int, peers: list[str], timeout: float) -> pb.LinkProbeReply:
        """Runs rank `rank` of a link probe between `peers` on this node (link_survey.py)."""
        return await self.stub.ProbeLink(
            pb.LinkProbeRequest(rank=rank, peers=peers, timeout_seconds=timeout),
            timeout=timeout + 30.0, metadata=self.metadata)

    async def unload_shard(self, model_id: str, grace: float,
                           worker_pid: int = 0) -> pb.UnloadShardReply:
        """Stops the worker of `model_id` (`worker_pid`: only the one of that pid, serving or
        kept serving after a move): SIGTERM, `grace` seconds, SIGKILL; returns once it has
        exited."""
        return await self.stub.UnloadShard(
            pb.UnloadShardRequest(model_id=model_id, grace_seconds=grace, worker_pid=worker_pid),
            timeout=grace + 30.0, metadata=self.metadata)

    async def prepare_weights(self, manifest: pb.WeightManifest,
                              timeout: float = PREPARE_TIMEOUT_SECONDS) -> pb.WeightNeeds:
        return await self.stub.PrepareWeights(manifest, timeout=timeout, metadata=self.metadata)

    def push_weights(self, chunks: AsyncIterator[pb.WeightChunk]):
        """A bidirectional stream: `read()` its WeightAcks; no deadline (a large range takes
        as long as it takes: omlx_coordinator/nodes/weight_transfer.py watches the acks instead)."""
        return self.stub.PushWeights(chunks, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()


class WorkerClient:
    """The head worker of a plan: where sequences go."""

    def __init__(self, address: str, channel: grpc.aio.Channel, session: str):
        self.address = address
        self.channel = channel
        self.stub = pb_grpc.ShardWorkerStub(self.channel)
        self.metadata = ((auth.SESSION_METADATA, session),)
        self.session = WorkerSession(self.stub, self.metadata)

    async def health(self, timeout: float = 2.0) -> pb.HealthReply:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout,
                                      metadata=self.metadata)

    def generate(self, request: pb.GenerateRequest, timeout: float) -> SessionCall:
        """A sequence of this worker's session, used as a server-streaming call is: iterate it
        for TokenChunks; `.cancel()` frees the sequence."""
        return self.session.generate(request, timeout)

    async def encode(self, request: pb.EncodeRequest, timeout: float) -> pb.EncodeReply:
        """An embedding or reranking model's rows for `request`'s inputs."""
        return await self.stub.Encode(request, timeout=timeout, metadata=self.metadata)

    async def transcribe(self, request: pb.TranscribeRequest,
                         timeout: float) -> pb.TranscribeReply:
        """A speech-to-text model's transcript of `request`'s audio file."""
        return await self.stub.Transcribe(request, timeout=timeout, metadata=self.metadata)

    async def close(self) -> None:
        self.session.close()
        await self.channel.close()
