"""The cluster secret, proven without ever crossing the wire, over a channel bound to both ends.

Every control-plane channel is mutual TLS with certificates of the cluster CA, which every holder
of the secret derives from it (omlx_shared/cluster_tls.py): a process without the secret cannot
complete a TLS handshake, and one in the TCP path between two holders sees only ciphertext.
Admission then runs inside that channel, a challenge-response both ways (NodeAgent.Handshake
then NodeAgent.Admit) over the transcript

    T = (c_nonce, n_nonce, node_id, fingerprint of the coordinator's TLS certificate)

    coordinator -> node   Handshake(c_nonce, version)
    node -> coordinator   node_id, n_nonce, HMAC(secret, "node", T)
    coordinator -> node   Admit(HMAC(secret, "coordinator", T))

The node reads the fingerprint from the TLS session it is called over, the coordinator knows its
own: a relay that terminates TLS presents another certificate (if it can present one at all),
and both proofs fail. The node's id is the one its certificate names, which the coordinator
dialled. Nonces are single use: the node refuses a coordinator nonce it has seen, and an Admit
consumes its handshake. Both sides then derive the session token HMAC(secret, "session", T),
which the coordinator sends on every later call to the node and its shard worker; they accept it
only over a TLS session with that same coordinator certificate (`bind`, `presented`), so a token
copied out of one connection is useless from any other. A new admission replaces it.

`join --coordinator` registrations are signed too (`registration`, `Registrations`): an HMAC over
the address, the node id, a timestamp and a nonce, each accepted once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from omlx_shared import cluster_tls
from omlx_shared.private_files import PrivateFileError, read_private
from omlx_shared.secret_strength import weakness

SECRET_ENV = "OMLX_CLUSTER_SECRET"
SESSION_METADATA = "x-omlx-session"
SESSION_ENV = "OMLX_SESSION_TOKEN"  # how an agent hands the session to its shard worker
NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


class SecretError(ValueError):
    """A secret (or its file) that cannot be used; the message says why and how to fix it."""


def secret_from(value: str | None, path: Path | None = None) -> str | None:
    """The secret given on the command line, else read from `path` (--secret-file, which keeps
    it out of `ps`), else $OMLX_CLUSTER_SECRET, else None. A weak one is refused: guesses at it
    can be checked offline (docs/security.md)."""
    if value:
        return _strong(value, "--secret")
    if path is not None:
        try:
            return _strong(read_private(path, "secret"), f"the secret file {path}")
        except PrivateFileError as e:
            raise SecretError(str(e)) from None
    env = os.environ.get(SECRET_ENV)
    return _strong(env, f"${SECRET_ENV}") if env else None


def _strong(secret: str, source: str) -> str:
    if (why := weakness(secret)) is not None:
        raise SecretError(f"the cluster secret from {source} is too weak to guard the cluster: "
                          f"{why}. Make a random one with `omlx-cluster secret new --file "
                          f"FILE` and pass --secret-file FILE")
    return secret


def write_secret(path: Path, secret: str, overwrite: bool = False) -> None:
    """Writes `secret` to a new file at `path`, mode 0600 from the start (in a 0700 folder if
    it makes one); an existing file is kept unless `overwrite`: it may guard a cluster."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise SecretError(f"{path} exists (it may hold a cluster's secret): pass --force to "
                          "replace it") from None
    except OSError as e:
        raise SecretError(f"cannot write {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file that existed keeps its mode through O_TRUNC
        f.write(secret + "\n")


def proof(secret: str, role: str, *parts: bytes | str) -> bytes:
    mac = hmac.new(cluster_tls.stretched(secret), role.encode(), hashlib.sha256)
    for p in parts:
        data = p.encode() if isinstance(p, str) else p
        mac.update(len(data).to_bytes(4, "big") + data)  # unambiguous concatenation
    return mac.digest()


def check(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


@dataclass(frozen=True)
class Transcript:
    """What both admission proofs and the session token cover."""

    coordinator_nonce: bytes
    node_nonce: bytes
    node_id: str
    coordinator_cert: str  # the fingerprint of the coordinator's TLS certificate

    def proof(self, secret: str, role: str) -> bytes:
        return proof(secret, role, self.coordinator_nonce, self.node_nonce, self.node_id,
                     self.coordinator_cert)

    def session_token(self, secret: str) -> str:
        return self.proof(secret, "session").hex()


def compatible(a: str, b: str) -> bool:
    """Versions that may share a cluster: the same major.minor (the wire format may change
    between minor versions)."""
    return a.split(".")[:2] == b.split(".")[:2]


def bind(cert_fingerprint: str, token: str) -> str:
    """A session as a server keeps it: the token and the client certificate it belongs to."""
    return f"{cert_fingerprint}/{token}"


def presented(context) -> str:
    """The session a gRPC caller presents: the token it sent (empty if none) bound to the
    certificate of the TLS session it came over. Equal to the server's `bind(...)` only for the
    admitted coordinator's own connection."""
    token = dict(context.invocation_metadata()).get(SESSION_METADATA, "")
    return bind(cluster_tls.peer_fingerprint(context), token)


REGISTRATION_WINDOW_SECONDS = 120.0  # how far a node's clock may be from the coordinator's


class RegistrationError(ValueError):
    """A registration the coordinator refuses; the message says why."""


def _registration_proof(secret: str, address: str, node_id: str, timestamp: int,
                        nonce: str) -> str:
    return proof(secret, "register", address, node_id, str(timestamp), nonce).hex()


def registration(secret: str, address: str, node_id: str) -> dict:
    """The body of a `join --coordinator` registration, signed with the secret."""
    timestamp, nonce = int(time.time()), secrets.token_hex(16)
    return {"address": address, "node_id": node_id, "timestamp": timestamp, "nonce": nonce,
            "proof": _registration_proof(secret, address, node_id, timestamp, nonce)}


class Registrations:
    """Checks signed registrations; each nonce is accepted once (a captured registration
    replayed later is refused; its timestamp bounds how long a nonce must be remembered)."""

    def __init__(self, secret: str | None):
        self.secret = secret
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten

    def verify(self, body: dict) -> tuple[str, str]:
        """(address, node id) of a valid registration; raises RegistrationError."""
        if self.secret is None:
            raise RegistrationError("this coordinator has no cluster secret: nodes cannot "
                                    "register with it")
        address, node_id = body.get("address"), body.get("node_id")
        timestamp, nonce, given = body.get("timestamp"), body.get("nonce"), body.get("proof")
        if not (isinstance(address, str) and isinstance(node_id, str) and node_id
                and isinstance(timestamp, int) and isinstance(nonce, str) and nonce
                and isinstance(given, str)):
            raise RegistrationError("the registration is not signed: send address, node_id, "
                                    "timestamp, nonce and proof (`omlx-cluster join` does)")
        expected = _registration_proof(self.secret, address, node_id, timestamp, nonce)
        if not check(expected.encode(), given.encode()):
            raise RegistrationError("the registration's proof does not match: the node does "
                                    "not hold this cluster's secret")
        now = time.time()
        if abs(now - timestamp) > REGISTRATION_WINDOW_SECONDS:
            raise RegistrationError(
                f"the registration is {now - timestamp:+.0f}s old (more than "
                f"{REGISTRATION_WINDOW_SECONDS:.0f}s: replayed, or the node's clock is off)")
        self._seen = {n: t for n, t in self._seen.items() if t > now}
        if nonce in self._seen:
            raise RegistrationError("the registration was replayed (its nonce was used before)")
        self._seen[nonce] = timestamp + REGISTRATION_WINDOW_SECONDS
        return address, node_id
