"""The engine settings a node gives every shard worker it starts: serve's, join's and node's
engine flags, parsed once by the CLI and handed to the node agent typed (omlx_node/agent.py),
which sends them to each worker as JSON inside its WorkerConfig (omlx_node/worker_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from omlx_shared.block_hashes import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class EngineConfig:
    prefill_chunk: int | None = None  # None: sized for the device (batcher.device_prefill_chunk)
    max_batch: int = 64
    speculative: str = "auto"  # omlx_node.speculation's mode (drafts on the head, rank 0)
    speculative_rows: int | None = None  # None: the crossover measured at start-up
    stream_interval: float = 0.02  # seconds (session.Session's interval)
    cache_block_size: int = DEFAULT_BLOCK_SIZE
    hot_cache_bytes: int = 0  # 0: no prefix cache at all
    ssd_cache_dir: str | None = None  # None: RAM only
    ssd_cache_bytes: int = 0
    device_cache_bytes: int | None = None  # None: sized for the device (device_tier)
    log_level: str = "info"
