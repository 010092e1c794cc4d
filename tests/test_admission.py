"""Only a coordinator that holds the cluster secret may drive a node, and versions must match."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from omlx_coordinator.node_client import AdmissionError, AgentClient, WorkerClient
from omlx_shared import __version__, auth
from omlx_shared.child import ChildProcess, omlx_command
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.tiny_models import build_model

SECRET = "correct horse battery staple"


@pytest.fixture(scope="module")
def node():
    env = dict(os.environ, **{auth.SECRET_ENV: SECRET})
    proc = ChildProcess(omlx_command("node", "--port", "0", "--name", "mac-a"), "node", env=env)
    info = proc.wait_ready(60)
    yield f"127.0.0.1:{info['port']}", proc
    proc.stop()


def run(coro):
    return asyncio.run(coro)


def test_wrong_secret_is_refused_both_ways(node):
    address, proc = node

    async def attempt(secret):
        client = AgentClient(address)
        try:
            return await client.admit(secret)
        finally:
            await client.close()

    with pytest.raises(AdmissionError, match="does not hold this cluster's secret"):
        run(attempt("wrong"))
    with pytest.raises(AdmissionError, match="refused this coordinator: wrong cluster secret"):
        run(attempt(None))  # a coordinator without the secret cannot prove itself

    # A coordinator that skips the node check still cannot prove itself to the node.
    async def forged():
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.NodeAgentStub(channel)
        await stub.Handshake(pb.HandshakeRequest(coordinator_nonce=auth.new_nonce(),
                                                 version=__version__), timeout=5)
        try:
            await stub.Admit(pb.AdmitRequest(proof=b"x" * 32), timeout=5)
        finally:
            await channel.close()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(forged())
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "wrong cluster secret" in err.value.details()
    assert "refused coordinator" in proc.log_tail()


def test_version_mismatch_is_refused(node):
    address, proc = node

    async def old_coordinator():
        channel = grpc.aio.insecure_channel(address)
        try:
            await pb_grpc.NodeAgentStub(channel).Handshake(
                pb.HandshakeRequest(coordinator_nonce=auth.new_nonce(), version="0.0.1"),
                timeout=5)
        finally:
            await channel.close()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(old_coordinator())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version mismatch" in err.value.details() and "0.0.1" in err.value.details()
    assert "runs omlx-cluster 0.0.1" in proc.log_tail()


def test_calls_need_the_session_and_the_secret_never_travels(node, tmp_path):
    address, _ = node
    model = build_model(tmp_path / "m", "llama", num_layers=2)

    async def scenario():
        intruder = AgentClient(address)  # never admitted
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await intruder.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await intruder.close()

        client = AgentClient(address)
        hello = await client.admit(SECRET)
        assert hello.node_id == "mac-a" and hello.memory_bytes > 0
        assert SECRET.encode() not in hello.SerializeToString()
        reply = await client.load_shard(pb.LoadShardRequest(model_path=str(model),
                                                            model_id="m"))
        assert (await client.health()).ready

        # The shard worker takes the same session, and nothing else.
        stranger = WorkerClient(reply.worker_address, "not-the-session")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stranger.stats()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        worker = WorkerClient(reply.worker_address, client.session)
        assert (await worker.stats()).running == 0

        # A second admission (a restarted coordinator) replaces the session.
        again = AgentClient(address)
        await again.admit(SECRET)
        with pytest.raises(grpc.aio.AioRpcError):
            await client.health()
        assert (await again.health()).ready
        for c in (stranger, worker, client, again):
            await c.close()

    run(scenario())
