"""The hot tier of a stage's KV prefix cache: blocks as host arrays, capped in bytes, LRU.

The blocks it keeps are the very host copies `store` made, and the SSD tier's write queue shares
them, so no second copy waits for the disk. Only the cache's lock guards it: every method is
called with that lock held.
"""

from __future__ import annotations

from collections import OrderedDict

from omlx_node.kv_cache.blocks import Block, Layout
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
        """The block, marked as recently used; None if it is not held."""
        block = self.blocks.get(block_hash)
        if block is not None:
            self.blocks.move_to_end(block_hash)
        return block

    def insert(self, block: Block) -> None:
        if block.hash in self.blocks:
            self.blocks.move_to_end(block.hash)
            return
        if block.nbytes > self.max_bytes:
            return  # it would evict everything and still not fit
        self.blocks[block.hash] = block
        self.nbytes += block.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.metrics.evictions.labels(tier="ram").inc()

    def drop_other_layouts(self, layout: Layout) -> None:
        """Drops the blocks whose layout is not `layout`."""
        for h in [h for h, b in self.blocks.items() if b.layout != layout]:
            self.nbytes -= self.blocks.pop(h).nbytes

    def update_gauges(self) -> None:
        self.metrics.bytes.labels(tier="ram").set(self.nbytes)
        self.metrics.blocks.labels(tier="ram").set(len(self.blocks))
