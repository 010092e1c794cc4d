"""Blocks of a stage's KV prefix cache: how they are named, what they hold, and how they are cut
out of and put back into mlx-lm KVCaches.

A sliding-window layer (mlx-lm's RotatingKVCache) keeps the keys and values of its last tokens
only, but they are per-token values like a full-attention layer's, so its blocks are the same:
they are cut while the layer still holds their tokens (the batcher stores after every prefill
chunk, and a chunk's tokens are all in the window it just took: `cut_spans` copies them on the
device right then, before the host copy that may come later), and a restore gives it back all
the restored tokens, from which it keeps its window as it goes on (the stage runner makes it a
RotatingKVCache again).

A prompt is cut into blocks of `block_size` tokens, each named by omlx_shared.block_hashes (a
SHA-256 chain, shared with the coordinator, which routes a prompt by the names it knows). A block
holds the keys and values of this stage's layers for its tokens, as host (numpy) arrays: see
prefix_cache.py for why MLX stays on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

GiB = 1 << 30
MiB = 1 << 20


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


# A block's layout: dtype name and the (kv_heads, block_size, head_dim) shape of every key and
# value tensor. Blocks are only concatenated with blocks of the same layout.
Layout = tuple[str, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def with_tokens(layout: Layout, tokens: int) -> Layout:
    """`layout` for a block of `tokens` tokens (a tail holds fewer than block_size)."""
    name, keys, values = layout
    return (name, tuple((s[0], tokens, *s[2:]) for s in keys),
            tuple((s[0], tokens, *s[2:]) for s in values))


@dataclass(eq=False)
class Block:
    hash: str
    parent: str  # "" for the first block of a prompt
    dtype: DType
    # per layer of the stage, (kv_heads, tokens, head_dim), C-contiguous: tokens is block_size,
    # or fewer for a tail (prefix_cache.py)
    keys: list[np.ndarray]
    values: list[np.ndarray]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[1]

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


# What `cut_spans` cuts: stacks of same-shaped spans, each with the indexes of the spans it holds
# in the order [layer 0 keys, layer 0 values, layer 1 keys, ...].
Spans = list[tuple[mx.array, list[int]]]


def cut_spans(
    cache: Sequence[KVCache | RotatingKVCache], todo: list[int], block_size: int, dt: DType
) -> Spans:
    """Engine thread: the keys and values of blocks todo[0] .. todo[-1] (indexes into the chain of
    the tokens `cache` holds) of every layer of a batch-of-one cache of `dt` values, each of shape
    (kv_heads, tokens, head_dim), bfloat16 as its uint16 bits, copied on the device and
    evaluated. Every layer must still hold their tokens (`held_tokens`)."""
    return cut_range(cache, todo[0] * block_size, (todo[-1] + 1) * block_size, dt)


def cut_range(cache: Sequence[KVCache | RotatingKVCache], lo: int, hi: int, dt: DType) -> Spans:
    """`cut_spans` of the tokens [lo, hi), whole blocks or not (a tail)."""
    # Copies, not slices: a slice would share the cache's buffer, which the next step then could
    # not update in place. Stacked by shape (one stack for most models): on a GPU each fresh
    # device buffer costs an allocation, which one per layer and tensor would multiply.
    parts = []
    for c in cache:
        k, v, first = _in_order(c)
        if dt.mx == mx.bfloat16:
            k, v = k.view(mx.uint16), v.view(mx.uint16)
        parts += [k[0, :, lo - first : hi - first, :], v[0, :, lo - first : hi - first, :]]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, a in enumerate(parts):
        groups.setdefault(tuple(a.shape), []).append(i)
    spans = [(mx.stack([parts[i] for i in idx]), idx) for idx in groups.values()]
    mx.eval([stack for stack, _ in spans])
    return spans


def span_layout(spans: Spans, dt: DType, block_size: int) -> Layout:
    """The layout of the blocks `cut_spans` cut, known before they reach the host."""
    shapes = _in_span_order(spans, lambda stack: [(stack.shape[1], block_size, stack.shape[3])]
                            * stack.shape[0])
    return dt.name, tuple(shapes[0::2]), tuple(shapes[1::2])


def cache_layout(cache: Sequence[KVCache | RotatingKVCache], block_size: int) -> Layout:
    """The layout of the blocks a stage's cache is cut into, from one that holds any tokens
    (a stage's first forward pass tells it before a block is stored)."""
    def shape(a: mx.array) -> tuple[int, ...]:
        return a.shape[1], block_size, a.shape[3]

    return (BY_MX[cache[0].keys.dtype].name, tuple(shape(c.keys) for c in cache),
            tuple(shape(c.values) for c in cache))


def _in_span_order(spans: Spans, split) -> list:
    """`split(stack)`'s items (one per span the stack holds) put back in span order."""
    out: list = [None] * sum(len(idx) for _, idx in spans)
    for stack, idx in spans:
        for i, item in zip(idx, split(stack)):
            out[i] = item
    return out


def host_blocks(
    spans: Spans, hashes: list[str], todo: list[int], block_size: int, dt: DType
) -> list[Block]:
    """The blocks `todo` of spans `cut_spans` cut, copied into host memory (numpy only: any
    thread may run it on evaluated spans), one independent C-contiguous array per block, layer
    and tensor: a view would keep the whole span alive."""
    bs, base = block_size, todo[0]
    host = _in_span_order(spans, lambda stack: list(np.array(stack, copy=True)))
    new = []
    for i in todo:
        # np.array, not ascontiguousarray: a one-head slice (MLA, Gemma 3 1B) is contiguous
        # already, and ascontiguousarray would hand back a view.
        part = [np.array(a[:, (i - base) * bs : (i - base + 1) * bs], copy=True) for a in host]
        new.append(Block(hash=hashes[i], parent=hashes[i - 1] if i else "", dtype=dt,
                         keys=part[0::2], values=part[1::2]))
    return new


@dataclass(frozen=True)
class DeviceSpan:
    """Consecutive blocks [start, stop) of a cut the device tier keeps (device_tier.py): `parts`
    are its per layer keys and values, in `cut_spans`' order, each (kv_heads, tokens, head_dim)
    in the cache's dtype, its block 0 at token 0."""

    parts: list[mx.array]
    start: int
    stop: int


def build_caches(restored: list[Block | DeviceSpan], n_layers: int,
                 block_size: int) -> list[KVCache]:
    """One KVCache per layer holding the `restored` blocks in order (host blocks and device
    spans), with KVCache.step tokens of spare room: the prefill and decode steps that follow
    append without copying it all again. From host blocks alone, one copy into each layer's
    buffer; with device spans, one device concatenation per layer."""
    caches = [KVCache() for _ in range(n_layers)]
    if not restored:
        return caches
    bs = block_size
    n = sum(r.tokens if isinstance(r, Block) else (r.stop - r.start) * bs for r in restored)
    runs: list[list[Block] | DeviceSpan] = []  # consecutive host blocks go into one array
    for r in restored:
        last = runs[-1] if runs else None
        if isinstance(r, Block):
            if isinstance(last, list):
                last.append(r)
            else:
                runs.append([r])
        elif isinstance(last, DeviceSpan) and last.parts is r.parts and last.stop == r.start:
            runs[-1] = DeviceSpan(r.parts, last.start, r.stop)  # one slice, not one per block
        else:
            runs.append(r)
    host_only = len(runs) == 1 and isinstance(runs[0], list)
    arrays = []
    for j, c in enumerate(caches):
        pair = []
        for t in (0, 1):  # keys, values
            if host_only:
                pair.append(_host_buffer([(b.keys, b.values)[t][j] for b in runs[0]], n,
                                         runs[0][0].dtype))
                continue
            pieces = [_piece(r, 2 * j + t, bs) for r in runs]
            heads, _, dim = pieces[0].shape
            pieces.append(mx.zeros((heads, KVCache.step, dim), pieces[0].dtype))
            pair.append(mx.concatenate(pieces, axis=1)[None])
        c.keys, c.values = pair
        c.offset = n
        arrays += pair
    mx.eval(arrays)
    return caches


def _piece(run: list[Block] | DeviceSpan, part: int, bs: int) -> mx.array:
    """One run's tokens of one layer tensor (`part` in cut_spans' order), (kv_heads, tokens,
    head_dim) in the cache's dtype."""
    if isinstance(run, DeviceSpan):
        return run.parts[part][:, run.start * bs : run.stop * bs]
    layer, t = divmod(part, 2)
    return _to_mx(np.concatenate([(b.keys, b.values)[t][layer] for b in run], axis=1),
                  run[0].dtype)


def _host_buffer(parts: list[np.ndarray], n: int, dt: DType) -> mx.array:
    """Host blocks' parts of one layer tensor as one (1, kv_heads, n + step, head_dim) array."""
    heads, _, dim = parts[0].shape
    buf = np.zeros((1, heads, n + KVCache.step, dim), parts[0].dtype)
    at = 0
    for part in parts:
        buf[0, :, at : at + part.shape[1]] = part
        at += part.shape[1]
    return _to_mx(buf, dt)


def _to_mx(a: np.ndarray, dt: DType) -> mx.array:
    return from_bits(mx.array(a), dt)


def from_bits(a: mx.array, dt: DType) -> mx.array:
    """An array of `dt` values as blocks hold them (bfloat16 as its uint16 bits) in `dt`."""
    return a.view(mx.bfloat16) if dt.mx == mx.bfloat16 else a
