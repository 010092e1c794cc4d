"""A worker's config crosses from its agent as JSON and comes back the same types; JSON that
does not make one is refused naming the field, and the CLI's engine flags become an
EngineConfig once, in the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_cluster.flags import engine_config
from omlx_cluster.parser import build_parser
from omlx_node.worker_config import WorkerConfig, WorkerJob
from omlx_shared.engine_config import EngineConfig
from omlx_shared.typed_json import ConfigError


def test_a_job_comes_back_as_it_was_sent() -> None:
    job = WorkerJob(WorkerConfig(Path("/models/m"), "m", 2, None, rank=1,
                                 peers=("10.0.0.1:5000", "10.0.0.2:5000"), tensor=True,
                                 engine=EngineConfig(prefill_chunk=8, stream_interval=0,
                                                     ssd_cache_dir="/kv")),
                    {"OMLX_SESSION": "s"})
    back = WorkerJob.from_json(job.to_json())
    assert back == job
    assert isinstance(back.config.model_path, Path) and isinstance(back.config.peers, tuple)
    assert isinstance(back.config.engine.stream_interval, float)


def test_a_rank_finds_its_tensor_stage_in_a_pipeline_of_them() -> None:
    """Stages of 2 and 1 ranks over 3 peers: ranks 0 and 1 are stage 0, rank 2 alone; the
    stage sizes come back a tuple of ints."""
    peers = ("a:1", "b:1", "c:1")
    stages = [WorkerConfig(Path("/m"), "m", 0, 2, rank=r, peers=peers, stage_ranks=(2, 1))
              for r in range(3)]
    assert [c.tensor_stage() for c in stages] == [(0, 2), (0, 2), (2, 1)]
    assert WorkerConfig(Path("/m"), "m", 0, 2, rank=1, peers=peers).tensor_stage() == (1, 1)
    back = WorkerJob.from_json(WorkerJob(stages[2]).to_json()).config
    assert back == stages[2] and isinstance(back.stage_ranks, tuple)


@pytest.mark.parametrize("text, message", [
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": 0}}',
     "WorkerJob.config: missing field(s) layer_end"),
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": 0, "layer_end": null, '
     '"max_batch": 8}}', "WorkerJob.config: unknown field(s) max_batch"),
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": "0", "layer_end": null}}',
     "WorkerJob.config.layer_start: expected int, got '0'"),
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": 0, "layer_end": null, '
     '"peers": "a,b"}}', "WorkerJob.config.peers: expected a list, got 'a,b'"),
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": 0, "layer_end": null, '
     '"engine": {"hot_cache_bytes": "1GiB"}}}',
     "WorkerJob.config.engine.hot_cache_bytes: expected int, got '1GiB'"),
    ('{"config": {"model_path": "/m", "model_id": "m", "layer_start": 0, "layer_end": null}, '
     '"env": {"A": 1}}', "WorkerJob.env['A']: expected str, got 1"),
    ("argv --model m", "WorkerJob: not JSON"),
])
def test_a_job_that_is_not_one_is_refused_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        WorkerJob.from_json(text)
    assert str(e.value).startswith(message)


def test_the_engine_flags_become_an_engine_config(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "node", "--max-batch", "8", "--hot-cache-max-size", "64MB", "--stream-interval", "5",
        "--paged-ssd-cache-dir", str(tmp_path), "--device-cache-max-size", "0",
        "--speculative", "off", "--log-level", "debug"])
    assert engine_config(args) == EngineConfig(
        prefill_chunk=None, max_batch=8, speculative="off", stream_interval=0.005,
        hot_cache_bytes=64 * 10**6, ssd_cache_dir=str(tmp_path), ssd_cache_bytes=16 << 30,
        device_cache_bytes=0, log_level="debug")
    ram_only = build_parser().parse_args(["node", "--paged-ssd-cache-max-size", "0"])
    assert engine_config(ram_only).ssd_cache_dir is None
