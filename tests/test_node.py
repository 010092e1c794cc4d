"""A node agent and its shard worker as separate processes, driven over their real gRPC
contract (proto/omlx.proto)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx_shared.blas import blas_env
from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.conftest import parse_metrics
from tests.tiny_models import build_model
from tests.helpers.node import running_node
from tests.helpers.session import SessionClient, wait_idle


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("node-model"), "qwen3", num_layers=3)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_node(tmp_path_factory.mktemp("node"), "--metrics-port", "0",
                      "--prefill-chunk", "4") as node:
        yield node


@pytest.mark.slow
def test_load_generate_cancel_stats(node, model):
    proc, agent = node
    health = agent.Health(pb.HealthRequest(), timeout=5)
    assert not health.ready and health.pid == proc.pid and health.data_port > 0

    with pytest.raises(grpc.RpcError) as err:  # the worker's stderr reaches the caller
        agent.LoadShard(pb.LoadShardRequest(model_path="/nonexistent/model"), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "/nonexistent/model" in err.value.details() and "exited with code" in err.value.details()

    with pytest.raises(grpc.RpcError) as err:
        agent.LoadShard(pb.LoadShardRequest(model_path=str(model), world_size=2,
                                            peers=["127.0.0.1:1"]), timeout=60)
    assert "needs 2 peers" in err.value.details()

    reply = agent.LoadShard(pb.LoadShardRequest(model_path=str(model), model_id="m"), timeout=120)
    assert (reply.layer_start, reply.layer_end, reply.num_layers) == (0, 3, 3)
    assert reply.dtype == "float32" and reply.worker_pid != proc.pid
    # The agent gives its workers the BLAS (`join`'s as much as `serve`'s), whatever its own
    # environment had: this agent was started without it.
    environ = dict(v.split("=", 1) for v in Path(f"/proc/{reply.worker_pid}/environ").read_text(
        errors="replace").split("\0") if "=" in v)
    assert environ.get("LD_PRELOAD") == blas_env({}).get("LD_PRELOAD")
    channel = grpc.insecure_channel(reply.worker_address)
    stub = pb_grpc.ShardWorkerStub(channel)

    ref_model, tok = load(str(model))
    ids = tok.encode("The capital of France is")
    ref = [int(t) for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=12)]
    session = SessionClient(stub)
    chunks = list(session.generate(pb.GenerateRequest(request_id="a", prompt_tokens=ids,
                                                      max_tokens=12), timeout=60))
    assert [t for c in chunks for t in c.tokens] == ref
    assert chunks[0].prompt_tokens == len(ids) and chunks[-1].finish_reason == "length"

    with pytest.raises(grpc.RpcError) as err:
        list(session.generate(pb.GenerateRequest(request_id="b", prompt_tokens=[10**7],
                                                 max_tokens=2), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in err.value.details()

    # A sequence cancelled by id, and a client that goes away mid-stream (the session's call
    # ends), free their sequences on the node.
    stream = session.generate(pb.GenerateRequest(request_id="c", prompt_tokens=ids,
                                                 max_tokens=1500), timeout=60)
    next(stream)
    session.cancel("c")
    stream = session.generate(pb.GenerateRequest(request_id="d", prompt_tokens=ids,
                                                 max_tokens=1500), timeout=60)
    next(stream)
    session.close()
    idle = wait_idle(stub)
    assert idle["omlx_node_requests_processing"] == 0
    assert idle["omlx_node_requests_deferred"] == 0
    assert idle["omlx_node_tokens_predicted_total"] < 2000

    health = stub.Health(pb.HealthRequest(), timeout=5)
    assert health.ready and health.model_id == "m" and health.metrics_port > 0
    text = httpx.get(f"http://127.0.0.1:{health.metrics_port}/metrics", timeout=5).text
    exported = parse_metrics(text)
    assert exported['omlx_node_requests_finished_total{reason="cancelled"}'] == 2.0
    assert "omlx_node_time_to_first_token_seconds_count" in exported
    # Every series names its stage; this agent is one node holding every layer.
    for label in ('model="m"', 'node="', 'plan=""', 'stage="0"', 'layers="0:3"'):
        assert label in text
    # A scrape that names its series (the agent's probe, the rebalancer) gets those alone.
    named = ["omlx_node_mlx_active_bytes", "omlx_node_requests_finished_total"]
    only = httpx.get(f"http://127.0.0.1:{health.metrics_port}/metrics",
                     params={"name[]": named}, timeout=5).text
    assert {key.split("{")[0] for key in parse_metrics(only)} == set(named)
    assert 'stage="0"' in only and 'reason="cancelled"' in only

    agent_health = agent.Health(pb.HealthRequest(), timeout=5)
    assert agent_health.ready and agent_health.worker_pid == reply.worker_pid
    assert agent_health.metrics_port == health.metrics_port  # the port bound, not "0"
    channel.close()

    # A new plan replaces the worker process (an mx.distributed group is formed once per process).
    again = agent.LoadShard(pb.LoadShardRequest(model_path=str(model), model_id="m",
                                                layer_start=0, layer_end=3), timeout=120)
    assert again.worker_pid != reply.worker_pid
    deadline = time.monotonic() + 10
    while _alive(reply.worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(reply.worker_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] in "ZX"


def test_a_named_scrape_skips_the_memory_probes(monkeypatch):
    """The worker's PSS walk runs only for a scrape that asks for its series: an idle node's
    agent probes MLX's memory every few seconds, and must not pay for the walk each time."""
    from omlx_node import metrics as node_metrics
    from omlx_shared.prometheus import labelled

    calls = []
    probes = tuple((name, doc, lambda probe=probe, name=name: calls.append(name) or probe())
                   for name, doc, probe in node_metrics._MachineCollector.PROBES)
    monkeypatch.setattr(node_metrics._MachineCollector, "PROBES", probes)
    exported = labelled(node_metrics.NodeMetrics().registry, {"node": "n"})

    def names(registry) -> set[str]:
        return {s.name for family in registry.collect() for s in family.samples}

    assert names(exported.restricted_registry(["omlx_node_mlx_active_bytes"])) == {
        "omlx_node_mlx_active_bytes"}
    assert calls == []
    footprint = "omlx_node_process_footprint_bytes"
    assert names(exported.restricted_registry([footprint])) == {footprint}
    assert calls == [footprint, "omlx_node_memory_pressure"]
    assert footprint in names(exported)  # a plain scrape still has everything
