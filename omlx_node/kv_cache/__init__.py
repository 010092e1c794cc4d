"""The tiered KV prefix cache of one stage (`PrefixCache`), one module per part:

- prefix_cache: `PrefixCache`, which composes the parts below, and how the batcher uses it;
- blocks: blocks (named by omlx_shared.block_hashes), cut out of / put into mlx-lm KVCaches;
- device_tier: the latest prompts' blocks kept on the device (on where it has memory of its own);
- ram_tier: the hot tier, a byte-capped LRU of host arrays;
- ssd_tier: the cold tier, block files under a byte cap, written by one background thread;
- ssd_format: the safetensors file of a block and the checks a file must pass;
- siblings: reuse of the blocks of other layer ranges after a re-plan, and pruning old ranges;
- metrics: its Prometheus metrics (`omlx_node_kv_cache_*`).
"""

from omlx_node.kv_cache.metrics import KVCacheMetrics
from omlx_node.kv_cache.prefix_cache import CacheStats, PrefixCache
from omlx_node.kv_cache.ssd_tier import model_dir_name
from omlx_shared.block_hashes import block_hashes

__all__ = ["CacheStats", "KVCacheMetrics", "PrefixCache", "block_hashes", "model_dir_name"]
