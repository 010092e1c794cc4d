"""The cluster's certificate authority, derived from the cluster secret, and the mTLS
credentials of the control plane (coordinator -> node agent, coordinator -> head worker).

Every holder of the secret derives the same CA private key from it (HKDF-SHA256 -> an EC P-256
scalar), so every holder can mint and verify certificates and nobody else can; the secret and
the CA key never leave the process. Each process (each coordinator connection, each agent) makes
its own key pair at start and a leaf certificate for its identity, signed by that CA:

    coordinator           the identity a node agent accepts admission from
    node:<node id>        a node agent and the shard workers it starts

A leaf names its identity twice: a URI SAN (`omlx-cluster:<identity>`, read back by the server
side from the TLS session) and a DNS SAN `host_name(identity)`, which the client's TLS check
compares with the `grpc.ssl_target_name_override` it dialled. So a coordinator that dials node
`mac-a` talks to a process holding a certificate for `node:mac-a`, wherever the TCP path leads,
and a process without the secret between them sees only ciphertext.

A process started without a secret (`omlx-cluster node` with none, tests that run a node open)
keeps the insecure channel, and says so in its log.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from urllib.parse import quote, unquote

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
TLS_ENV = "OMLX_TLS_CREDENTIALS"  # how an agent hands its credentials to its shard worker
_URI_PREFIX = "omlx-cluster:"
# P-256's group order: a derived scalar must lie in [1, n - 1].
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# Fixed, so every holder of the secret builds the same CA certificate (up to its signature,
# which a verifier never checks: the root is trusted by its name and key).
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "omlx-cluster CA")])
_CA_VALID = (datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
             datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc))


def node_identity(node_id: str) -> str:
    return f"node:{node_id}"


def host_name(identity: str) -> str:
    """The DNS name a leaf carries for `identity`: node ids need not be valid DNS labels."""
    return f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.omlx-cluster"


@functools.lru_cache(maxsize=4)
def stretched(secret: str) -> bytes:
    """The key every use of the secret derives from: scrypt (32 MiB, slow on purpose) rather
    than the secret itself, because what the secret yields can be seen (a node's certificate
    names its CA's key; a registration carries an HMAC), and a guess at a human-chosen secret
    could otherwise be checked against it at a plain hash's speed. Once per process."""
    return hashlib.scrypt(secret.encode(), salt=b"omlx-cluster secret v1", n=1 << 15, r=8,
                          p=1, maxmem=64 << 20, dklen=32)


@functools.lru_cache(maxsize=4)
def _ca(secret: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"omlx-cluster CA v1",
               info=b"cluster CA private key").derive(stretched(secret))
    # 48 bytes reduced mod n - 1: the bias is below 2^-128.
    key = ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1,
                                ec.SECP256R1())
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(_CA_NAME).issuer_name(_CA_NAME).public_key(key.public_key())
            .serial_number(int.from_bytes(ski.digest[:16], "big") >> 1)
            .not_valid_before(_CA_VALID[0]).not_valid_after(_CA_VALID[1])
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


@dataclass(frozen=True)
class Credentials:
    """One process's key pair and leaf certificate, and the cluster CA it trusts."""

    identity: str
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the leaf certificate: what the peer sees of this end of the channel."""
        return fingerprint(x509.load_pem_x509_certificate(self.cert_pem))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)],
                                           root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def to_env(self) -> dict[str, str]:
        return {TLS_ENV: json.dumps({"identity": self.identity, "key": self.key_pem.decode(),
                                     "cert": self.cert_pem.decode(),
                                     "ca": self.ca_pem.decode()})}

    @classmethod
    def from_env(cls) -> Credentials | None:
        """The credentials the agent handed its shard worker (None: it runs without TLS)."""
        raw = os.environ.get(TLS_ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(d["identity"], d["key"].encode(), d["cert"].encode(), d["ca"].encode())


def issue(secret: str, identity: str) -> Credentials:
    """A fresh key pair and a leaf certificate for `identity`, signed by the secret's CA."""
    ca_key, ca_cert = _ca(secret)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        host_name(identity))]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            # A day back: the Macs' clocks may disagree a little. The key lives only in this
            # process's memory, so the certificate dies with it whatever its end date.
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(_CA_VALID[1])
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName(host_name(identity)),
                x509.UniformResourceIdentifier(_URI_PREFIX + quote(identity, safe=":"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Credentials(
        identity=identity,
        key_pem=key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        ca_pem=ca_cert.public_bytes(serialization.Encoding.PEM))


def fingerprint(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def identity_of(cert: x509.Certificate) -> str:
    """The identity a leaf certificate names ("" if it names none)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(_URI_PREFIX)]
    return unquote(uris[0].removeprefix(_URI_PREFIX)) if uris else ""


def peer_certificate(context: grpc.ServicerContext) -> x509.Certificate | None:
    """The client certificate of a call's TLS session, verified by gRPC against the cluster CA
    (None over an insecure port)."""
    pem = context.auth_context().get("x509_pem_cert")
    return x509.load_pem_x509_certificate(pem[0]) if pem else None


def peer_fingerprint(context: grpc.ServicerContext) -> str:
    """The fingerprint of the caller's certificate ("" over an insecure port)."""
    pem = context.auth_context().get("x509_pem_cert")
    return _pem_fingerprint(pem[0]) if pem else ""


@functools.lru_cache(maxsize=64)
def _pem_fingerprint(pem: bytes) -> str:
    # Every call to a worker checks its caller's session against this: parsing the same
    # certificate each time added to every request's first token.
    return fingerprint(x509.load_pem_x509_certificate(pem))


def tls_refusal(error: grpc.RpcError) -> str:
    """Why a call failed in the TLS handshake, in words ("" if it failed otherwise). gRPC only
    says so in the error's text."""
    details = error.details() or ""
    if "Hostname Verification Check failed" in details:
        return "its certificate names another identity"
    if "handshake failed" in details.lower():
        return "its certificate is not from this cluster's CA"
    return ""


def add_port(server: grpc.Server, address: str, credentials: Credentials | None) -> int:
    """Listens on `address` with mutual TLS, or in the clear (logged) without credentials;
    returns the port (0: it could not bind)."""
    if credentials is None:
        log.warning("no cluster secret: the control plane on %s is NOT encrypted or "
                    "authenticated (any process that reaches it may drive it)", address)
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials.server_credentials())


def channel(address: str, credentials: Credentials | None, peer_identity: str) -> grpc.aio.Channel:
    """An async channel to the server at `address` that must hold a certificate for
    `peer_identity`, presenting `credentials`; in the clear (logged) without credentials."""
    if credentials is None:
        log.warning("no cluster secret: the control plane to %s (%s) is NOT encrypted or "
                    "authenticated", peer_identity, address)
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=credentials.ca_pem,
                                     private_key=credentials.key_pem,
                                     certificate_chain=credentials.cert_pem),
        # gRPC's hostname check then compares the server certificate's DNS name with the
        # identity we expect, not with the address we dialled (a TCP relay changes that).
        options=(("grpc.ssl_target_name_override", host_name(peer_identity)),))
