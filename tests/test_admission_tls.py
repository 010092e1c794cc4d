"""Admission bound to the channel: relays, men in the middle, replays and stolen sessions, all
against a real node agent on loopback (omlx_shared/auth.py, omlx_shared/cluster_tls.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from unittest import mock

import grpc
import httpx
import pytest

from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.nodes.node_client import AdmissionError, AgentClient
from omlx_node.agent import NodeAgent
from omlx_shared import __version__, auth, cluster_tls
from omlx_shared.child import ChildProcess, omlx_command
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.cluster_secret import SECRET
from tests.tiny_models import serving

NODE = "mac-a"


@pytest.fixture(scope="module")
def node():
    env = dict(os.environ, **{auth.SECRET_ENV: SECRET})
    proc = ChildProcess(omlx_command("node", "--port", "0", "--name", NODE), "node", env=env)
    info = proc.wait_ready(60)
    yield f"127.0.0.1:{info['port']}", proc
    proc.stop()


def run(coro):
    return asyncio.run(coro)


def admissions(proc: ChildProcess) -> int:
    """How many coordinators the node has admitted so far (its log says each)."""
    return proc.log_path.read_text(errors="replace").count("admitted by the coordinator")


class TcpRelay:
    """A man in the middle on loopback: forwards every TCP connection made to it to `upstream`
    and records the bytes each way."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.to_server: list[bytearray] = []  # one per connection
        self.to_client: list[bytearray] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, port = self.upstream.rsplit(":", 1)
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection((host, int(port)))
            self._sockets += [client, server]
            up, down = bytearray(), bytearray()
            self.to_server.append(up)
            self.to_client.append(down)
            for src, dst, record in ((client, server, up), (server, client, down)):
                threading.Thread(target=self._pump, args=(src, dst, record), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray) -> None:
        try:
            while data := src.recv(65536):
                record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def recorded(self) -> bytes:
        return b"".join(bytes(b) for b in self.to_server + self.to_client)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        for s in self._sockets:
            s.close()


class GrpcRelay(pb_grpc.NodeAgentServicer):
    """The audit's relay: a gRPC server that forwards Handshake and Admit to the real agent over
    a channel of its own (once admitted, it would be sent the session token)."""

    def __init__(self, upstream: grpc.aio.Channel):
        self.stub = pb_grpc.NodeAgentStub(upstream)
        self.forwarded: list[str] = []

    async def Handshake(self, request, context):
        self.forwarded.append("Handshake")
        return await self.stub.Handshake(request, timeout=5)

    async def Admit(self, request, context):
        self.forwarded.append("Admit")
        return await self.stub.Admit(request, timeout=5)


def coordinator_channel(address: str, secret: str) -> grpc.aio.Channel:
    """A channel to mac-a as a coordinator holding `secret` opens it."""
    return cluster_tls.channel(address, cluster_tls.issue(secret, cluster_tls.COORDINATOR),
                               cluster_tls.node_identity(NODE))


def node_credentials(secret: str) -> cluster_tls.Credentials:
    return cluster_tls.issue(secret, cluster_tls.node_identity(NODE))


async def refused_admission(servicer: pb_grpc.NodeAgentServicer,
                            credentials: grpc.ServerCredentials, reason: str) -> None:
    """Serves `servicer` on loopback as node mac-a; a coordinator holding the secret that tries
    to admit it there is refused for `reason`, and holds no session to send."""
    server = grpc.aio.server()
    pb_grpc.add_NodeAgentServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    coordinator = AgentClient(f"127.0.0.1:{port}", NODE, SECRET)
    try:
        with pytest.raises(AdmissionError, match=reason):
            await coordinator.admit()
        assert coordinator.session == ""
    finally:
        await coordinator.close()
        await server.stop(None)


@pytest.mark.slow  # a node agent process (`node`)
def test_a_relay_without_the_secret_is_not_admitted_and_cannot_drive_the_agent(node):
    address, proc = node

    async def scenario():
        # Without the secret the relay can only make up a CA of its own: a certificate for
        # mac-a from it, and a coordinator certificate to talk to the agent with.
        guess = "not the secret"
        upstream = coordinator_channel(address, guess)
        relay = GrpcRelay(upstream)
        own = node_credentials(guess)
        try:
            await refused_admission(relay, grpc.ssl_server_credentials(
                [(own.key_pem, own.cert_pem)]),  # it takes any client, to get the most out of it
                "does not hold this cluster's secret")
            assert relay.forwarded == []  # it never saw a message
            # Nor can it reach the agent on its own behalf.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.NodeAgentStub(upstream).Handshake(pb.HandshakeRequest(
                    coordinator_nonce=auth.new_nonce(), version=__version__), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await upstream.close()

    before = admissions(proc)
    run(scenario())
    assert admissions(proc) == before


@pytest.mark.slow  # a node agent process (`node`)
def test_a_relay_with_the_secret_cannot_pass_on_an_admission(node):
    """A relay that does hold a valid certificate terminates TLS itself, so the agent sees the
    relay's client certificate, not the coordinator's: the node's proof covers that one, and the
    coordinator refuses it (before it has a session token to send)."""
    address, proc = node

    async def scenario():
        upstream = coordinator_channel(address, SECRET)
        relay = GrpcRelay(upstream)
        try:
            await refused_admission(relay, node_credentials(SECRET).server_credentials(),
                                    "does not cover this connection")
            assert relay.forwarded == ["Handshake", "Admit"]  # the empty Admit of a refusal
        finally:
            await upstream.close()

    run(scenario())
    assert "does not match a handshake of this connection" in proc.log_tail()


def replay(address: str, data: bytes) -> bytes:
    """Sends `data` to `address` on a new connection; returns all it answers until it closes."""
    host, port = address.rsplit(":", 1)
    answer = b""
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(5)
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer


@pytest.mark.slow  # a node agent process (`node`)
def test_a_man_in_the_middle_sees_only_ciphertext_and_cannot_replay_it(node):
    address, proc = node
    relay = TcpRelay(address)

    async def scenario():
        # The TLS session runs end to end, through the relay.
        client = AgentClient(relay.address, NODE, SECRET)
        try:
            await client.admit()
            await client.health()  # a call that carries the session token
            recorded = relay.recorded()
            assert len(relay.to_server) == 1 and len(recorded) > 1000
            for clear in (client.session.encode(), bytes.fromhex(client.session),
                          SECRET.encode(), NODE.encode(), auth.SESSION_METADATA.encode()):
                assert clear not in recorded

            # Replayed to the agent, the recorded client bytes are a TLS handshake that cannot
            # finish (the agent answers with fresh keys), so nothing in them reaches it.
            before = admissions(proc)
            answer = await asyncio.to_thread(replay, address, bytes(relay.to_server[0]))
            assert client.session.encode() not in answer and NODE.encode() not in answer
            assert admissions(proc) == before
            assert (await client.health()).version == __version__  # its session stands
        finally:
            await client.close()

    try:
        run(scenario())
    finally:
        relay.close()


@pytest.mark.slow  # a node agent process (`node`)
def test_replayed_handshake_and_admit_messages_are_refused(node):
    address, _ = node

    def stub_of(channel: grpc.aio.Channel) -> pb_grpc.NodeAgentStub:
        return pb_grpc.NodeAgentStub(channel)

    async def scenario():
        creds = cluster_tls.issue(SECRET, cluster_tls.COORDINATOR)
        channels = [cluster_tls.channel(address, creds, cluster_tls.node_identity(NODE)),
                    coordinator_channel(address, SECRET)]
        mine, theirs = (stub_of(c) for c in channels)
        try:
            hello_request = pb.HandshakeRequest(coordinator_nonce=auth.new_nonce(),
                                                version=__version__)
            hello = await mine.Handshake(hello_request, timeout=5)
            transcript = auth.Transcript(hello_request.coordinator_nonce, hello.node_nonce, NODE,
                                         creds.fingerprint)
            assert auth.check(transcript.proof(SECRET, "node"), hello.proof)
            admit = pb.AdmitRequest(proof=transcript.proof(SECRET, "coordinator"))

            async def refused(call, request) -> str:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                return err.value.details()

            # The Admit replayed over another connection (another coordinator certificate,
            # with a handshake of its own pending) is refused...
            await theirs.Handshake(pb.HandshakeRequest(coordinator_nonce=auth.new_nonce(),
                                                       version=__version__), timeout=5)
            assert "admission refused" in await refused(theirs.Admit, admit)
            # ...it admits once over its own...
            await mine.Admit(admit, timeout=5)
            # ...and never again, nor does the handshake's nonce open a second one.
            assert "admission refused" in await refused(mine.Admit, admit)
            assert "used before" in await refused(mine.Handshake, hello_request)
            assert "used before" in await refused(theirs.Handshake, hello_request)
        finally:
            for c in channels:
                await c.close()

    run(scenario())


class ReplayedAnswers(pb_grpc.NodeAgentServicer):
    """A node (it holds the secret, and mac-a's certificate) that answers every Handshake with
    an answer recorded from an earlier admission."""

    def __init__(self, hello: pb.HandshakeReply):
        self.hello = hello

    async def Handshake(self, request, context):
        return self.hello

    async def Admit(self, request, context):
        return pb.AdmitReply()


@pytest.mark.slow  # a node agent process (`node`)
def test_a_coordinator_refuses_a_replayed_handshake_answer(node):
    address, _ = node

    async def scenario():
        recorder = AgentClient(address, NODE, SECRET)
        hello = await recorder.admit()
        await recorder.close()
        await refused_admission(ReplayedAnswers(hello),
                                node_credentials(SECRET).server_credentials(),
                                "does not cover this connection")

    run(scenario())


@pytest.mark.slow  # a node agent process (`node`)
def test_a_stolen_session_token_is_useless_from_another_channel(node, llama_2_layers):
    address, _ = node

    async def scenario():
        client = AgentClient(address, NODE, SECRET)
        # The thief even holds the secret: another certificate is all it takes to be refused.
        thief = AgentClient(address, NODE, SECRET)
        try:
            await client.admit()
            reply = await client.load_shard(pb.LoadShardRequest(model_path=str(llama_2_layers),
                                                                model_id="m"))
            thief.session = client.session
            for call in (thief.health(), thief.worker(reply.worker_address).health()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # The session still serves its own channel, to the agent and to its worker.
            assert (await client.health()).ready
            assert (await client.worker(reply.worker_address).health()).ready
        finally:
            await client.close()
            await thief.close()

    run(scenario())


@pytest.mark.slow  # a node agent process (`node`)
def test_a_registration_never_displaces_a_live_member(node, llama_2_layers, caplog):
    """The audit's serve-mode failure: a relay registered under the node's id took its place.
    Registrations are signed now, and no admission takes a live member's place."""
    address, _ = node
    relay = TcpRelay(address)

    async def scenario():
        manager = serving(llama_2_layers, "tiny-tls", ClusterOptions(nodes=0, secret=SECRET,
                                                            os_reserve_bytes=0))
        cluster, served = manager.cluster, manager.main
        app = create_app(manager, start_cluster=False)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                async def register(body: dict) -> httpx.Response:
                    r = await http.post("/cluster/register", json=body)
                    await asyncio.gather(*app.state.registrar.admitting)
                    return r

                unsigned = await register({"address": relay.address})
                assert unsigned.status_code == 401, unsigned.text
                forged = await register(auth.registration("a guess", relay.address, NODE))
                assert forged.status_code == 401 and "does not match" in forged.text

                signed = auth.registration(SECRET, address, NODE)
                assert (await register(signed)).status_code == 202
                assert served.ready, served.status
                epoch = served.epoch
                replayed = await register(signed)
                assert replayed.status_code == 401 and "replayed" in replayed.text
                with mock.patch.object(auth.time, "time", return_value=time.time() - 3600):
                    stale = auth.registration(SECRET, address, NODE)  # signed an hour ago
                r = await register(stale)
                assert r.status_code == 401 and "replayed, or the node's clock is off" in r.text

                # The relay leads to the real agent, so it would pass every proof: only the
                # live member it would displace stops it. Announced (Bonjour carries no
                # signature) or registered by a holder of the secret, it is refused alike.
                assert await cluster.add_remote(relay.address, NODE) is None
                assert (await register(auth.registration(SECRET, relay.address, NODE))
                        ).status_code == 202
                assert [(m.name, m.agent.address) for m in cluster.members] == [(NODE, address)]
                assert served.ready and served.epoch == epoch
                assert (await served.node.health()).ready  # it still serves
                assert (await register(auth.registration(SECRET, address, NODE))
                        ).json() == {"status": "member"}
        finally:
            await manager.stop()

    with caplog.at_level(logging.WARNING, logger="omlx_coordinator"):
        try:
            run(scenario())
        finally:
            relay.close()
    refusals = [r.getMessage() for r in caplog.records if "live member" in r.getMessage()]
    assert len(refusals) == 2 and all(relay.address in m for m in refusals), refusals
    assert any("refused a registration" in r.getMessage() for r in caplog.records)


def test_without_a_secret_the_control_plane_says_it_is_open(caplog):
    with caplog.at_level(logging.WARNING, logger="omlx_shared.cluster_tls"):
        agent = NodeAgent(secret=None, node_id="open", standby=False)
    agent.server.stop(None)
    assert agent.tls is None
    assert any("NOT encrypted or authenticated" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # a node agent process (`node`)
def test_a_guess_at_the_secret_costs_a_scrypt_not_a_hash(node):
    """An attacker on the LAN reads a node's certificate without any credential (the TLS
    handshake shows it before the node asks for the client's): its Authority Key Identifier
    names the cluster CA's key, which the secret determines. Each guess must cost scrypt: the
    CA derived straight from a right guess (as it was) does not match; the stretched one does."""
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    address, _ = node
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw) as tls:
            leaf = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value

    def key_id(material: bytes) -> bytes:
        okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"omlx-cluster CA v1",
                   info=b"cluster CA private key").derive(material)
        key = ec.derive_private_key(int.from_bytes(okm, "big") % (cluster_tls._P256_ORDER - 1)
                                    + 1, ec.SECP256R1())
        return x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest

    assert aki.key_identifier == key_id(cluster_tls.stretched(SECRET))
    assert aki.key_identifier != key_id(SECRET.encode())  # the fast check an attacker wanted
