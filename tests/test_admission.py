"""Only a coordinator that holds the cluster secret may drive a node, and versions must match.
(Relays, replays and stolen sessions: tests/test_admission_tls.py.)"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from omlx_coordinator.nodes.node_client import AdmissionError, AgentClient
from omlx_shared import __version__, auth, cluster_tls
from omlx_shared.child import ChildProcess, omlx_command
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.cluster_secret import SECRET
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow  # every test drives a node agent process (`node`)


@pytest.fixture(scope="module")
def node():
    env = dict(os.environ, **{auth.SECRET_ENV: SECRET})
    proc = ChildProcess(omlx_command("node", "--port", "0", "--name", "mac-a"), "node", env=env)
    info = proc.wait_ready(60)
    yield f"127.0.0.1:{info['port']}", proc
    proc.stop()


def run(coro):
    return asyncio.run(coro)


def coordinator_channel(address: str, secret: str = SECRET) -> grpc.aio.Channel:
    """A channel as a coordinator holding `secret` opens it, for hand-made calls."""
    return cluster_tls.channel(address, cluster_tls.issue(secret, cluster_tls.COORDINATOR),
                               cluster_tls.node_identity("mac-a"))


def test_wrong_secret_is_refused_both_ways(node):
    address, proc = node

    async def attempt(secret, node_id="mac-a"):
        client = AgentClient(address, node_id, secret)
        try:
            return await client.admit()
        finally:
            await client.close()

    # The secrets' CAs differ: the TLS handshake fails before any admission message.
    with pytest.raises(AdmissionError, match="does not hold this cluster's secret.*CA"):
        run(attempt("wrong"))
    # The right CA, but the server's certificate is mac-a's, not mac-b's.
    with pytest.raises(AdmissionError, match="names another identity"):
        run(attempt(SECRET, "mac-b"))
    # A coordinator without the secret cannot even speak to the node: it listens only on TLS.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(attempt(None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    # A coordinator that skips the node check still cannot prove itself to the node.
    async def forged():
        channel = coordinator_channel(address)
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
    assert "admission refused" in err.value.details()
    assert "refused coordinator" in proc.log_tail()


def test_version_mismatch_is_refused(node):
    address, proc = node

    async def old_coordinator():
        channel = coordinator_channel(address)
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
        intruder = AgentClient(address, "mac-a", SECRET)  # never admitted
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await intruder.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await intruder.close()

        client = AgentClient(address, "mac-a", SECRET)
        hello = await client.admit()
        assert hello.node_id == "mac-a" and hello.memory_bytes > 0
        assert SECRET.encode() not in hello.SerializeToString()
        reply = await client.load_shard(pb.LoadShardRequest(model_path=str(model),
                                                            model_id="m"))
        assert (await client.health()).ready

        # The shard worker takes the same session, and nothing else.
        stranger = intruder.worker(reply.worker_address)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stranger.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        worker = client.worker(reply.worker_address)
        assert (await worker.health()).ready

        # A second admission (a restarted coordinator) replaces the session.
        again = AgentClient(address, "mac-a", SECRET)
        await again.admit()
        with pytest.raises(grpc.aio.AioRpcError):
            await client.health()
        assert (await again.health()).ready
        for c in (stranger, worker, client, again):
            await c.close()

    run(scenario())
