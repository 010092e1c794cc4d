"""A node's id: this Mac's name plus a key kept in its data folder, so it is stable across
restarts and unique even when an office has five Macs called "MacBook-Pro"."""

from __future__ import annotations

import os
import secrets
import socket

from omlx_shared.model_store import data_home

KEY_FILE = "node-key"


def node_key() -> str:
    """A random key made once per data folder ($OMLX_CLUSTER_HOME/node-key, mode 0600)."""
    path = data_home() / KEY_FILE
    try:
        key = path.read_text().strip()
        if key:
            return key
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_hex(8)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    # Private from its first byte: a chmod after the write would leave it readable meanwhile.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(key + "\n")
    os.replace(tmp, path)
    return path.read_text().strip()


def default_node_id() -> str:
    """`<short host name>-<first 6 hex of the node key>`, e.g. `MacBook-Pro-3fa9c1`."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{node_key()[:6]}"
