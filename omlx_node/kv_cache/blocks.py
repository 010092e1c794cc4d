"""Blocks of a stage's KV prefix cache: how they are named, what they hold, and how they are cut
out of and put back into mlx-lm KVCaches.

A sliding-window layer (mlx-lm's RotatingKVCache) keeps the keys and values of its last tokens
only, but they are per-token values like a full-attention layer's, so its blocks are the same:
they are cut while the layer still holds their tokens (the batcher stores after every prefill
chunk, and a chunk's tokens are all in the window it just took), and a restore gives it back all
the restored tokens, from which it keeps its window as it goes on (the stage runner makes it a
RotatingKVCache again).

A prompt is cut into blocks of `block_size` tokens; block i is named by a SHA-256 chain over the
model id, block i-1's hash and block i's token ids, so a name stands for the whole prefix up to
the end of that block and a block is only ever reused at its own position. A block holds the keys
and values of this stage's layers for its tokens, as host (numpy) arrays: see prefix_cache.py for
why MLX stays on the engine thread.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

GiB = 1 << 30
MiB = 1 << 20
_HASH_DOMAIN = b"omlx-kv-v1\0"


@dataclass(frozen=True)
class DType:
    name: str  # as ShardInfo.dtype spells it
    st: str  # as safetensors spells it
    np: type  # how numpy holds the bytes: bfloat16 as its raw uint16 bits
    mx: mx.Dtype


DTYPES = (
    DType("float32", "F32", np.float32, mx.float32),
    DType("float16", "F16", np.float16, mx.float16),
    DType("bfloat16", "BF16", np.uint16, mx.bfloat16),
)
BY_NAME = {d.name: d for d in DTYPES}
BY_MX = {d.mx: d for d in DTYPES}


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


# A block's layout: dtype name and the (kv_heads, block_size, head_dim) shape of every key and
# value tensor. Blocks are only concatenated with blocks of the same layout.
Layout = tuple[str, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


@dataclass(eq=False)
class Block:
    hash: str
    parent: str  # "" for the first block of a prompt
    dtype: DType
    keys: list[np.ndarray]  # per layer of the stage, (kv_heads, block_size, head_dim), C-contiguous
    values: list[np.ndarray]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def layout(self) -> Layout:
        return (
            self.dtype.name,
            tuple(a.shape for a in self.keys),
            tuple(a.shape for a in self.values),
        )


def _in_order(cache: KVCache | RotatingKVCache) -> tuple[mx.array, mx.array, int]:
    """A layer cache's keys and values in token order, and the position of their first token."""
    if isinstance(cache, RotatingKVCache):
        # Its buffer may have wrapped around; mlx-lm's own reordering puts it back in order.
        keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        return keys, values, cache.offset - keys.shape[2]
    return cache.keys, cache.values, 0


def held_tokens(cache: Sequence[KVCache | RotatingKVCache]) -> tuple[int, int]:
    """The tokens [start, end) whose keys and values every layer of a batch-of-one stage cache
    still holds (a sliding-window layer only its last ones)."""
    ranges = [(c.offset - _in_order(c)[0].shape[2], c.offset) if isinstance(c, RotatingKVCache)
              else (0, c.offset) for c in cache]
    return max(a for a, _ in ranges), min(b for _, b in ranges)


def cut_blocks(
    cache: Sequence[KVCache | RotatingKVCache], hashes: list[str], todo: list[int],
    block_size: int, dt: DType
) -> list[Block]:
    """Copies blocks `todo` (indexes into `hashes`, the chain of the tokens `cache` holds) out of
    a batch-of-one cache of `dt` values into host memory, one Block each. Every layer must still
    hold their tokens (`held_tokens`)."""
    # All slices evaluated together (one graph), then copied out of the step-rounded buffer
    # into independent host arrays: a view would keep the whole buffer alive.
    bs = block_size
    slices = []
    for c in cache:
        k, v, first = _in_order(c)
        if dt.mx == mx.bfloat16:
            k, v = k.view(mx.uint16), v.view(mx.uint16)
        for i in todo:
            slices.append(k[0, :, i * bs - first : (i + 1) * bs - first, :])
            slices.append(v[0, :, i * bs - first : (i + 1) * bs - first, :])
    mx.eval(slices)
    # Contiguous: a chunk that exactly fills mlx-lm's buffer can leave a transposed layout,
    # which the writer's memoryview cannot serialise.
    host = [np.ascontiguousarray(np.array(a)) for a in slices]

    new = []
    for b, i in enumerate(todo):
        at = [(j * len(todo) + b) * 2 for j in range(len(cache))]
        new.append(
            Block(
                hash=hashes[i],
                parent=hashes[i - 1] if i else "",
                dtype=dt,
                keys=[host[a] for a in at],
                values=[host[a + 1] for a in at],
            )
        )
    return new


def build_caches(blocks: list[Block], n_layers: int, block_size: int) -> list[KVCache]:
    """One KVCache per layer holding `blocks` in order: one copy of the blocks into each layer's
    buffer, with KVCache.step tokens of spare room: the prefill and decode steps that follow
    append without copying it all again."""
    caches = [KVCache() for _ in range(n_layers)]
    if not blocks:
        return caches
    bs = block_size
    n = len(blocks) * bs
    dt = blocks[0].dtype
    arrays = []
    for j, c in enumerate(caches):
        pair = []
        for parts in ([b.keys[j] for b in blocks], [b.values[j] for b in blocks]):
            heads, _, dim = parts[0].shape
            buf = np.zeros((1, heads, n + KVCache.step, dim), parts[0].dtype)
            for i, part in enumerate(parts):
                buf[0, :, i * bs : (i + 1) * bs] = part
            a = mx.array(buf)
            pair.append(a.view(mx.bfloat16) if dt.mx == mx.bfloat16 else a)
        c.keys, c.values = pair
        c.offset = n
        arrays += pair
    mx.eval(arrays)
    return caches
