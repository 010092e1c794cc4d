"""Several models on one node: a real node agent owns one shard worker per model, loads and
unloads each on its own, and reports each in Health (proto/omlx.proto WorkerStatus)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from proto import omlx_pb2 as pb
from proto import omlx_pb2_grpc as pb_grpc
from tests.helpers.node import running_node
from tests.helpers.session import generate_chunks
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow  # a real node agent starting and stopping shard workers

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("node-models")
    return {"a": build_model(root / "a", "qwen3", num_layers=3),
            "b": build_model(root / "b", "llama", num_layers=2, seed=1)}


@pytest.fixture(scope="module")
def references(models) -> dict[str, tuple[list[int], list[int]]]:
    """Each model's prompt ids and greedy continuation, from mlx-lm in this process."""
    out = {}
    for name, path in models.items():
        model, tok = load(str(path))
        ids = tok.encode(PROMPT)
        out[name] = ids, [int(t) for t, _ in generate_step(mx.array(ids), model,
                                                           max_tokens=MAX_TOKENS)]
    return out


@pytest.fixture(scope="module")
def metrics_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def agent(tmp_path_factory, metrics_port):
    with running_node(tmp_path_factory.mktemp("node"), "--metrics-port",
                      str(metrics_port)) as (_, stub):
        yield stub


def load_model(agent, models, name: str, plan_hash: str = "") -> pb.LoadShardReply:
    return agent.LoadShard(pb.LoadShardRequest(model_path=str(models[name]), model_id=name,
                                               plan_hash=plan_hash), timeout=180)


def workers(agent) -> dict[str, pb.WorkerStatus]:
    return {w.model_id: w for w in agent.Health(pb.HealthRequest(), timeout=5).workers}


def generated(address: str, ids: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        chunks = generate_chunks(pb_grpc.ShardWorkerStub(channel), pb.GenerateRequest(
            request_id=f"r{time.monotonic_ns()}", prompt_tokens=ids, max_tokens=MAX_TOKENS),
            timeout=60)
        return [t for c in chunks for t in c.tokens]


def serves(agent, references, name: str) -> bool:
    ids, ref = references[name]
    return generated(workers(agent)[name].worker_address, ids) == ref


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"


def test_two_models_serve_side_by_side(agent, models, references, metrics_port):
    a, b = load_model(agent, models, "a"), load_model(agent, models, "b")
    assert a.worker_pid != b.worker_pid and a.worker_address != b.worker_address
    assert alive(a.worker_pid)  # loading b left a's worker running
    assert serves(agent, references, "a") and serves(agent, references, "b")

    health = agent.Health(pb.HealthRequest(), timeout=5)
    assert [w.model_id for w in health.workers] == ["a", "b"]  # in load order
    listed = {w.model_id: w for w in health.workers}
    for reply in (a, b):
        w = listed[reply.model_id]
        assert w.ready and w.status == "ready" and w.pid == reply.worker_pid
        assert w.worker_address == reply.worker_address
        assert (w.layer_start, w.layer_end, w.num_layers) == (
            reply.layer_start, reply.layer_end, reply.num_layers)
        assert w.rank == 0 and w.world_size == 1
        assert w.footprint_bytes > 0  # probed once the load finished
    # The agent's --metrics-port binds once: the first worker has it, the second any port.
    assert listed["a"].metrics_port == metrics_port
    assert listed["b"].metrics_port not in (0, metrics_port)
    assert 0 < health.memory_available_bytes <= health.memory_total_bytes
    assert health.memory_pressure in ("normal", "warn", "critical")
    # The top-level fields are the worker loaded last's, as single-model readers expect.
    assert health.ready and health.model_id == "b" and health.worker_pid == b.worker_pid
    assert health.metrics_port == listed["b"].metrics_port

    # MLX's active memory comes from each worker's own /metrics, refreshed about every second.
    deadline = time.monotonic() + 15
    while not all(w.mlx_active_bytes > 0 for w in workers(agent).values()):
        assert time.monotonic() < deadline, workers(agent)
        time.sleep(0.2)


def test_reloading_a_model_replaces_only_its_worker(agent, models, references):
    before = workers(agent)
    again = load_model(agent, models, "b", plan_hash="2e0d5a7c")
    assert again.worker_pid != before["b"].pid and not alive(before["b"].pid)
    after = workers(agent)
    assert list(after) == ["a", "b"] and after["b"].plan_hash == "2e0d5a7c"
    assert after["a"].pid == before["a"].pid and after["a"].ready
    assert serves(agent, references, "a") and serves(agent, references, "b")


def test_a_move_keeps_the_old_worker_serving_until_it_is_unloaded_by_pid(agent, models,
                                                                          references):
    """Make before break (keep_serving): the old worker serves on after the new one is ready,
    out of Health, until the coordinator unloads it by pid; an unload naming a pid that is
    not the model's leaves its worker; the model's full unload would stop both."""
    before = workers(agent)["b"]
    old_address = before.worker_address
    moved = agent.LoadShard(pb.LoadShardRequest(
        model_path=str(models["b"]), model_id="b", plan_hash="5b1c09aa", keep_serving=True,
        keep_serving_seconds=120, load_reason=pb.LOAD_MOVE), timeout=180)
    assert moved.worker_pid != before.pid and alive(before.pid)
    assert workers(agent)["b"].pid == moved.worker_pid  # Health reports the new one
    ids, ref = references["b"]
    assert generated(old_address, ids) == ref  # the old plan's requests run on
    assert serves(agent, references, "b")
    other = agent.UnloadShard(pb.UnloadShardRequest(model_id="b", worker_pid=workers(agent)[
        "a"].pid), timeout=30)
    assert not other.was_loaded and alive(before.pid) and alive(moved.worker_pid)
    reply = agent.UnloadShard(pb.UnloadShardRequest(model_id="b", worker_pid=before.pid,
                                                    grace_seconds=5), timeout=30)
    assert reply.was_loaded and not alive(before.pid) and alive(moved.worker_pid)
    assert serves(agent, references, "a") and serves(agent, references, "b")


def test_a_failed_load_leaves_the_other_models_running(agent, references):
    before = workers(agent)
    with pytest.raises(grpc.RpcError) as err:
        agent.LoadShard(pb.LoadShardRequest(model_path="/nonexistent/model", model_id="c"),
                        timeout=120)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    after = workers(agent)
    assert {m: w.pid for m, w in after.items()} == {m: w.pid for m, w in before.items()}
    assert all(w.ready for w in after.values())
    assert serves(agent, references, "a") and serves(agent, references, "b")


def test_unload_stops_one_model_and_frees_it(agent, references):
    pid = workers(agent)["a"].pid
    reply = agent.UnloadShard(pb.UnloadShardRequest(model_id="a"), timeout=30)
    assert reply.was_loaded and not reply.killed and reply.seconds < 10
    assert not alive(pid)  # exited before the reply: its memory is free
    assert list(workers(agent)) == ["b"]
    assert serves(agent, references, "b")
    again = agent.UnloadShard(pb.UnloadShardRequest(model_id="a"), timeout=30)
    assert not again.was_loaded and not again.killed


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(agent):
    pid = workers(agent)["b"].pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    reply = agent.UnloadShard(pb.UnloadShardRequest(model_id="b", grace_seconds=1.0),
                              timeout=30)
    assert reply.was_loaded and reply.killed and 1.0 <= reply.seconds < 10
    assert not alive(pid)
    health = agent.Health(pb.HealthRequest(), timeout=5)
    assert not health.workers and not health.ready and health.memory_total_bytes > 0
