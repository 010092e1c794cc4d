"""The names of KV cache blocks: a SHA-256 chain over a prompt's token blocks.

Shared because both sides need the same names: the node names the blocks it stores (in RAM and
as files on its SSD, so these bytes are an on-disk format: changing them orphans every stored
block), and the coordinator routes a prompt to the replica that already holds its prefix. Block
i's name covers the model id, block i-1's name and block i's token ids, so a name stands for the
whole prefix up to the end of that block and a block is only ever reused at its own position.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

_HASH_DOMAIN = b"omlx-kv-v1\0"

# Tokens per block. Agents re-send their conversation every turn, and a turn reuses only whole
# blocks of it: with 256-token blocks each turn prefilled up to 255 re-sent tokens again (the
# prompt's partial block and the model's own answer). 16 keeps the loss under 1% of a
# 1,500-token agent prompt; what more, smaller blocks cost is measured in
# bench/results/block-size-cpu.md.
DEFAULT_BLOCK_SIZE = 16


def block_hashes(model_id: str, tokens: Sequence[int], block_size: int) -> list[str]:
    """Hex SHA-256 chain over the FULL blocks of `tokens`:
    h_i = sha256(domain, len(model_id), model_id, h_{i-1} (32 zero bytes for i = 0), block i's ids
    as little-endian int64). The length prefix keeps (model id, tokens) pairs unambiguous."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    n = len(tokens) // block_size
    if n == 0:
        return []
    ids = np.asarray(tokens[: n * block_size], dtype="<i8").tobytes()
    mid = model_id.encode()
    prefix = _HASH_DOMAIN + struct.pack("<I", len(mid)) + mid
    step = block_size * 8
    parent = bytes(32)
    out = []
    for i in range(n):
        parent = hashlib.sha256(prefix + parent + ids[i * step : (i + 1) * step]).digest()
        out.append(parent.hex())
    return out


_TAIL_DOMAIN = b"omlx-kv-tail-v1\0"


def tail_hash(model_id: str, parent: str, tokens: Sequence[int]) -> str:
    """Hex SHA-256 name of a tail: the tokens (fewer than a block) that follow the full block
    `parent` ("" for none) at the end of a prompt or an answer. An agent's next turn re-sends
    them, so the cache keeps them beside the blocks (node only; the coordinator routes by blocks).
    h = sha256(tail domain, len(model_id), model_id, parent's 32 bytes (zeros for none), the
    tail's ids as little-endian int64)."""
    mid = model_id.encode()
    ids = np.asarray(tokens, dtype="<i8").tobytes()
    up = bytes.fromhex(parent) if parent else bytes(32)
    return hashlib.sha256(_TAIL_DOMAIN + struct.pack("<I", len(mid)) + mid + up + ids).hexdigest()
