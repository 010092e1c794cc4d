"""What a shard worker is started with: its plan's part (from the coordinator's LoadShardRequest)
and its node's engine settings, one typed config that crosses to the worker process as a JSON
line on its stdin. A worker is `python -m omlx_node.worker`; a standby one (started ahead of its
plan, omlx_node/agent.py) imports MLX while it waits for that line, at a background load's
priority (omlx_node/standby.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from omlx_node.load_priority import load_nice
from omlx_shared.blas import blas_env
from omlx_shared.child import ChildProcess
from omlx_shared.engine_config import EngineConfig
from omlx_shared.typed_json import from_json, to_json


@dataclass(frozen=True)
class WorkerConfig:
    model_path: Path
    model_id: str
    layer_start: int
    layer_end: int | None
    streamed_layers: int = 0  # the range's last layers kept on disk (omlx_node/layer_stream.py)
    rank: int = 0
    peers: tuple[str, ...] = ()
    backend: str = "ring"  # or "jaccl" (RDMA over Thunderbolt 5)
    # jaccl: MLX_IBV_DEVICES as JSON, one row per rank (omlx_coordinator/nodes/backend.py)
    rdma_devices: str = ""
    plan_hash: str = ""
    tensor: bool = False  # the ranks form one tensor-parallel stage (omlx_node.tensor)
    # A pipeline of tensor-parallel stages: each stage's rank count, in rank order (its ranks
    # hold the same layer range: omlx_node/sub_group.py). Empty: as `tensor` says.
    stage_ranks: tuple[int, ...] = ()
    micro_batches: int = 0
    host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: any free port
    node_id: str = ""  # the agent's, a label on every metric
    init_timeout: float = 60.0
    kind: str = "chat"  # omlx_shared.model_kinds: the other kinds run encoder_worker's
    # A pb.LoadReason: whether requests wait for this load, which sets its CPU priority
    # (omlx_node/load_priority.py). 0: unspecified, as a requested load.
    load_reason: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def world_size(self) -> int:
        return max(1, len(self.peers))

    def tensor_stage(self) -> tuple[int, int]:
        """The ranks [first, first + size) of this rank's stage in a pipeline of tensor
        stages; (rank, 1) in any other plan."""
        first = 0
        for size in self.stage_ranks:
            if first <= self.rank < first + size:
                return first, size
            first += size
        return self.rank, 1


@dataclass(frozen=True)
class WorkerJob:
    """The one line a worker reads on its stdin: its config, and what it adds to its
    environment (the session its callers present, its TLS credentials: never on a command
    line, where ps shows them)."""

    config: WorkerConfig
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return to_json(self)

    @classmethod
    def from_json(cls, text: str) -> WorkerJob:
        """Raises omlx_shared.typed_json.ConfigError naming a field it cannot take."""
        return from_json(cls, text)


def worker_process(what: str, log_level: str = "info", standby: bool = False,
                   import_nice: int | None = None) -> ChildProcess:
    """A shard worker process, up to where it waits for its job: send it
    `process.send_line(job.to_json())`. Its BLAS is chosen now: a library is preloaded when a
    process starts. It imports MLX and mlx-lm at a load's priority (omlx_node/standby.py): a
    `standby` (started before any job is due) at a background load's, any other at
    `import_nice` (its job's load's: `load_priority.load_nice`; None: its own)."""
    if standby:
        argv = ["-m", "omlx_node.standby"]
    elif import_nice:
        argv = ["-m", "omlx_node.standby", "--import-nice", str(import_nice)]
    else:
        argv = ["-m", "omlx_node.worker"]
    return ChildProcess([sys.executable, *argv, "--log-level", log_level],
                        what, env=blas_env(), stdin_pipe=True)


def start_worker(job: WorkerJob, what: str, log_level: str = "info") -> ChildProcess:
    """A shard worker process given `job` at once (an agent without a standby, tests), which
    imports at the priority of the job's load."""
    process = worker_process(what, log_level, import_nice=load_nice(job.config.load_reason))
    process.send_line(job.to_json())
    return process
