"""A node's id: this Mac's name plus a key kept in its data folder, so it is stable across
restarts and unique even when an office has five Macs called "MacBook-Pro"."""

from __future__ import annotations

import secrets
import socket

from omlx_shared.model_store import data_home
from omlx_shared.private_files import write_private

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
    write_private(path, secrets.token_hex(8) + "\n")
    return path.read_text().strip()  # a process that raced this one may have replaced it


def default_node_id() -> str:
    """`<short host name>-<first 6 hex of the node key>`, e.g. `MacBook-Pro-3fa9c1`."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{node_key()[:6]}"
