"""The hot tier of a stage's KV prefix cache: blocks as host arrays, capped in bytes, LRU.

The blocks it keeps are the very host copies `store` made, and the SSD tier's write queue shares
them, so no second copy waits for the disk. Only the cache's lock guards it: every method is
called with that lock held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from omlx_node.kv_cache.blocks import Block, Layout, with_tokens
from omlx_node.kv_cache.metrics import KVCacheMetrics


class RamTier:
    def __init__(self, max_bytes: int, metrics: KVCacheMetrics):
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # LRU first
        self.nbytes = 0

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self.blocks

    def get(self, block_hash: str) -> Block | None:
        """The block; None if it is not held."""
        return self.blocks.get(block_hash)

    def mark_chain(self, hashes: list[str], new: Mapping[str, Block] | None = None) -> None:
        """Marks a chain's blocks as recently used, its last block first, taking in those of
        `new` (by hash) it does not hold yet; only then evicts down to the cap, so the blocks
        it evicts are the chain's end, not its start (see PrefixCache._mark_used)."""
        for h in reversed(hashes):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            elif new and h in new and new[h].nbytes <= self.max_bytes:
                self.blocks[h] = new[h]
                self.nbytes += new[h].nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.metrics.evictions.labels(tier="ram").inc()

    def drop_other_layouts(self, layout: Layout) -> None:
        """Drops the blocks (and tails) whose layout is not `layout`."""
        for h in [h for h, b in self.blocks.items()
                  if b.layout != with_tokens(layout, b.tokens)]:
            self.nbytes -= self.blocks.pop(h).nbytes

    def update_gauges(self) -> None:
        self.metrics.bytes.labels(tier="ram").set(self.nbytes)
        self.metrics.blocks.labels(tier="ram").set(len(self.blocks))
