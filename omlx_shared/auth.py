"""The cluster secret, proven without ever crossing the wire.

Admission is a challenge-response both ways (NodeAgent.Handshake then NodeAgent.Admit):

    coordinator -> node   Handshake(c_nonce, version)
    node -> coordinator   node_id, n_nonce, HMAC(secret, "node", c_nonce, node_id)
    coordinator -> node   Admit(HMAC(secret, "coordinator", n_nonce, c_nonce))

Each side checks the other's proof with its own copy of the secret. Both then derive the session
token HMAC(secret, "session", c_nonce, n_nonce), which the coordinator sends as call metadata on
every later call to the node and to its shard worker; a new admission replaces it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

SECRET_ENV = "OMLX_CLUSTER_SECRET"
SESSION_METADATA = "x-omlx-session"
SESSION_ENV = "OMLX_SESSION_TOKEN"  # how an agent hands the session to its shard worker


def new_nonce() -> bytes:
    return secrets.token_bytes(32)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


class SecretError(ValueError):
    """A secret file that cannot be used; the message says why and how to fix it."""


def secret_from(value: str | None, path: Path | None = None) -> str | None:
    """The secret given on the command line, else read from `path` (--secret-file, which keeps
    it out of `ps`), else $OMLX_CLUSTER_SECRET, else None."""
    if value:
        return value
    if path is not None:
        try:
            mode = path.stat().st_mode
            secret = path.read_text().strip()
        except OSError as e:
            raise SecretError(f"cannot read the secret file {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"the secret file {path} is readable by other users "
                              f"(mode {stat.S_IMODE(mode):o}): `chmod 600 {path}`")
        if not secret:
            raise SecretError(f"the secret file {path} is empty")
        return secret
    return os.environ.get(SECRET_ENV) or None


def proof(secret: str, role: str, *parts: bytes | str) -> bytes:
    mac = hmac.new(secret.encode(), role.encode(), hashlib.sha256)
    for p in parts:
        data = p.encode() if isinstance(p, str) else p
        mac.update(len(data).to_bytes(4, "big") + data)  # unambiguous concatenation
    return mac.digest()


def check(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def session_token(secret: str, c_nonce: bytes, n_nonce: bytes) -> str:
    return proof(secret, "session", c_nonce, n_nonce).hex()


def compatible(a: str, b: str) -> bool:
    """Versions that may share a cluster: the same major.minor (the wire format may change
    between minor versions)."""
    return a.split(".")[:2] == b.split(".")[:2]


def presented(context) -> str:
    """The session token a gRPC caller sent (empty if none)."""
    return dict(context.invocation_metadata()).get(SESSION_METADATA, "")
