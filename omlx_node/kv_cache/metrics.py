"""Prometheus metrics of a stage's tiered KV prefix cache (`omlx_node_kv_cache_*`).

Counts are in blocks (a block is `block_size` tokens of every layer of the stage), so a hit ratio
is hits / (hits + misses) whatever the prompt lengths are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# A restore is a device copy (device), a memcpy (RAM) or a file read + hash (SSD):
# sub-millisecond to seconds.
RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

TIERS = ("device", "ram", "ssd")


class KVCacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lookups = Counter("omlx_node_kv_cache_lookups", "Prefix lookups", registry=r)
        self.hits = Counter(
            "omlx_node_kv_cache_hits",
            "Blocks restored instead of prefilled, by the tier they came from",
            ["tier"],
            registry=r,
        )
        self.misses = Counter(
            "omlx_node_kv_cache_misses",
            "Full blocks of looked-up prompts that no tier held (they get prefilled)",
            registry=r,
        )
        self.stored = Counter(
            "omlx_node_kv_cache_stored_blocks", "Blocks newly stored after a prefill", registry=r
        )
        self.bytes = Gauge(
            "omlx_node_kv_cache_bytes", "Bytes of KV blocks held, by tier", ["tier"], registry=r
        )
        self.blocks = Gauge(
            "omlx_node_kv_cache_blocks", "KV blocks held, by tier", ["tier"], registry=r
        )
        self.evictions = Counter(
            "omlx_node_kv_cache_evictions",
            "Blocks evicted to stay under a tier's byte cap",
            ["tier"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            "omlx_node_kv_cache_restore_seconds",
            "Time to rebuild a sequence's KV cache from cached blocks",
            buckets=RESTORE_BUCKETS,
            registry=r,
        )
        self.ssd_writes = Counter(
            "omlx_node_kv_cache_ssd_writes",
            "Block writes to the SSD tier, by result "
            "(ok, low_space, queue_full, too_large, error, disabled)",
            ["result"],
            registry=r,
        )
        self.ssd_rejected = Counter(
            "omlx_node_kv_cache_ssd_rejected_files",
            "Cache files removed because they were corrupt, truncated or foreign",
            ["reason"],
            registry=r,
        )
        self.ssd_enabled = Gauge(
            "omlx_node_kv_cache_ssd_writable",
            "1 while the SSD tier takes writes, 0 after it degraded to RAM-only",
            registry=r,
        )
        for tier in TIERS:
            self.hits.labels(tier=tier)
            self.bytes.labels(tier=tier)
            self.blocks.labels(tier=tier)
            self.evictions.labels(tier=tier)
