"""The device tier of a stage's KV prefix cache: the latest stored prompts' blocks, kept where the
engine computes.

On a GPU with memory of its own (MLX on CUDA allocates managed memory) a block in the RAM tier is a
poor hit: its host arrays must move back to the device page by page, which with the first step over
them took longer than prefilling the prompt again, where a copy kept on the device restores at once
(bench/results/kv-device-h200.md). Agents send the previous turn's whole conversation again, so the
hits that matter most are of the prompts stored last: those this tier keeps.

The copy it keeps is a cut of its own (`blocks.cut_spans`, cheap on the device), never the one
the copier thread reads: once the host has read a buffer its pages live on the host, and a
restore from it is slow again. Where host and device share memory (a CPU, Apple silicon) the RAM
tier restores at memory speed, so the tier is off by default there (`default_max_bytes`).

Engine thread only: its arrays are created, read and freed there. Whole cuts are evicted, least
recently used first: a cut is one device buffer, freed only when none of its blocks is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from omlx_node.kv_cache.blocks import DeviceSpan, DType, Spans, from_bits
from omlx_node.kv_cache.metrics import KVCacheMetrics

GiB = 1 << 30


def default_max_bytes() -> int:
    """1/16 of a CUDA device's memory, at most 8 GiB; 0 where host and device share memory."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return 0
    try:
        total = int(mx.device_info().get("total_memory", 0))
    except Exception:  # an MLX without device_info: no size to go by
        return 0
    return min(8 * GiB, total // 16)


@dataclass(eq=False)
class _Cut:
    parts: list[mx.array]  # per layer keys, values, ...: (kv_heads, tokens, head_dim) in dtype
    hashes: list[str]  # of its blocks, in order
    nbytes: int


class DeviceTier:
    def __init__(self, max_bytes: int, metrics: KVCacheMetrics):
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._cuts: OrderedDict[_Cut, None] = OrderedDict()  # LRU first
        self._where: dict[str, tuple[_Cut, int]] = {}  # block hash -> its cut and position
        self.nbytes = 0

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._where

    @property
    def blocks(self) -> int:
        return len(self._where)

    def keep(self, chain: list[str], start: int, stop: int, spans: Spans, dt: DType) -> None:
        """Keeps blocks [start, stop) of a prompt's chain of block hashes as `spans`, a cut of
        exactly them evaluated for this tier alone; then marks the chain used (`mark_chain`)
        and evicts down to the cap."""
        nbytes = sum(stack.nbytes for stack, _ in spans)
        if nbytes > self.max_bytes:
            return
        parts: list = [None] * sum(len(idx) for _, idx in spans)
        for stack, idx in spans:
            for j, i in enumerate(idx):
                parts[i] = from_bits(stack[j], dt)
        cut = _Cut(parts, chain[start:stop], nbytes)
        self._cuts[cut] = None
        self.nbytes += nbytes
        for pos, h in enumerate(cut.hashes):
            self._where[h] = (cut, pos)
        self.mark_chain(chain)
        while self.nbytes > self.max_bytes:
            self._evict(next(iter(self._cuts)))

    def span(self, block_hash: str) -> DeviceSpan | None:
        """The block as a span of one block (`build_caches` merges consecutive ones of a cut);
        None if it is not kept."""
        found = self._where.get(block_hash)
        if found is None:
            return None
        cut, pos = found
        return DeviceSpan(cut.parts, pos, pos + 1)

    def mark_chain(self, hashes: list[str]) -> None:
        """Marks the cuts holding a chain's blocks as recently used, its last block first: the
        cut a conversation's later turn stored is its end, evicted before the cut its every
        turn starts with (see PrefixCache._mark_used)."""
        for h in reversed(hashes):
            found = self._where.get(h)
            if found is not None:
                self._cuts.move_to_end(found[0])

    def clear(self) -> None:
        """Drops every cut (the stage's KV layout changed)."""
        for cut in list(self._cuts):
            self._evict(cut, count=False)

    def _evict(self, cut: _Cut, count: bool = True) -> None:
        del self._cuts[cut]
        self.nbytes -= cut.nbytes
        for h in cut.hashes:
            found = self._where.get(h)
            if found is not None and found[0] is cut:  # a later cut may hold it again
                del self._where[h]
                if count:
                    self.metrics.evictions.labels(tier="device").inc()

    def update_gauges(self) -> None:
        self.metrics.bytes.labels(tier="device").set(self.nbytes)
        self.metrics.blocks.labels(tier="device").set(self.blocks)
