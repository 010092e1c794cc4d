"""Shard workers started as a node agent starts them (`python -m omlx_node.worker` given its
WorkerJob on stdin), for tests that drive a pipeline or a tensor stage without an agent."""

from __future__ import annotations

from pathlib import Path

from omlx_cluster.flags import engine_config
from omlx_cluster.parser import build_parser
from omlx_node.worker_config import WorkerConfig, WorkerJob, start_worker
from omlx_shared.child import ChildProcess

PLAN_HASH = "0123456789abcdef"


def stage_worker(model: Path, rank: int, layers: tuple[int, int | None],
                 peers: tuple[str, ...] = (), engine_flags: tuple[str, ...] = (),
                 **fields) -> ChildProcess:
    """Rank `rank` of a plan over `peers`, serving `layers` of `model` as "m"; its engine
    settings are a node's with `engine_flags` (the CLI's flags, parsed by the CLI), the rest
    of its config `fields`."""
    engine = engine_config(build_parser().parse_args(["node", *engine_flags]))
    config = WorkerConfig(model_path=model, model_id="m", layer_start=layers[0],
                          layer_end=layers[1], rank=rank, peers=peers, plan_hash=PLAN_HASH,
                          engine=engine, **fields)
    return start_worker(WorkerJob(config), f"rank {rank}", engine.log_level)
