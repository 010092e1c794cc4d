"""Failure paths, each under the real condition: the gateway's answers to what a node does (an
error status, a hung worker, a recovery that outlasts the request, plans that keep changing, a
request whose worker dies under it twice), a node with no disk room for its range, the weight
store's refusals and a disk that fills mid-write, and the KV writer's dropped writes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest

from omlx_coordinator.errors import APIError
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.nodes.weight_transfer import WeightSource, ensure_weights
from omlx_coordinator.nodes.worker_session import WorkerSession
from omlx_coordinator.request.events import Delta, Done
from omlx_coordinator.request.generation import GatewaySettings, GenerationRequest, generate
from omlx_coordinator.request.retry import MAX_ATTEMPTS
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_node.kv_cache import PrefixCache
from omlx_node.weight_store import FREE_SPACE_MARGIN_BYTES, WeightError, WeightStore
from omlx_shared import auth
from proto import omlx_pb2 as pb
from tests.cluster_secret import SECRET
from tests.conftest import start_server
from tests.helpers.kv import BS, files, make_pc, metric, synthetic_cache
from tests.helpers.weights import (
    _can_mount,
    admitted,
    agent_process,
    assert_holds_exactly,
    chunk,
    push,
)
from tests.tiny_models import build_model, serving


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """4 layers of 9.4 MB each: a layer does not fit where the store keeps its margin."""
    return build_model(tmp_path_factory.mktemp("fp") / "wide-fp", "llama", num_layers=4,
                       hidden_size=512)


# ---- the gateway's generation core against a real cluster -------------------------------------

async def run_request(manager: ModelManager, req: GenerationRequest, settings: GatewaySettings,
                      on_first_delta: Callable[[ModelManager], None] | None = None
                      ) -> tuple[list[int], Done | APIError]:
    """One request through the generation core: its tokens and how it ended. `on_first_delta`
    runs on the first tokens of the request on each plan (each attempt, where every attempt
    runs on a new plan); it must not wait for a new plan itself, or the old attempt's last
    tokens would arrive on it."""
    tokens: list[int] = []
    epochs: set[int] = set()
    try:
        async for ev in generate(manager, manager.models[0], GatewayMetrics(), settings, req):
            if isinstance(ev, Delta) and ev.tokens:
                tokens += ev.tokens
                if on_first_delta and manager.main.epoch not in epochs:
                    epochs.add(manager.main.epoch)
                    on_first_delta(manager)
            elif isinstance(ev, Done):
                return tokens, ev
    except APIError as e:
        return tokens, e
    raise AssertionError("the generation ended without Done")


def serve(model: Path, scenario: Callable[[ModelManager], Awaitable], **options):
    async def main():
        manager = serving(model, model.name, ClusterOptions(secret=SECRET, **options))
        await manager.start()
        try:
            return await scenario(manager)
        finally:
            await manager.stop()

    return asyncio.run(main())


def head_worker(manager: ModelManager) -> int:
    return manager.cluster.members[0].health.worker_pid


def long_request(max_tokens: int = 1500) -> GenerationRequest:
    return GenerationRequest(prompt=[5, 6, 7, 8], max_tokens=max_tokens, temperature=0.0,
                             ignore_eos=True)


@pytest.mark.slow
def test_node_status_codes_map_to_http(model):
    """INVALID_ARGUMENT (the node refuses the request) is the client's 400; any other status
    that is not a lost node (here UNAUTHENTICATED: the worker does not take this session) is a
    503 naming the code."""
    async def scenario(cluster: ModelManager):
        settings = GatewaySettings(keepalive_seconds=0.5)
        bad = await run_request(cluster, GenerationRequest(prompt=[5, 6], max_tokens=0),
                                settings)
        node = cluster.main.node
        session = node.session
        node.session = WorkerSession(node.stub, ((auth.SESSION_METADATA, "not-the-session"),))
        refused = await run_request(cluster, long_request(4), settings)
        node.session.close()
        node.session = session
        fine = await run_request(cluster, long_request(4), settings)
        return bad, refused, fine

    (_, bad), (_, refused), (tokens, fine) = serve(model, scenario)
    assert isinstance(bad, APIError) and bad.status == 400
    assert bad.message == "max_tokens must be at least 1, got 0"
    assert isinstance(refused, APIError) and refused.status == 503
    assert refused.message.startswith("the node is unavailable (UNAUTHENTICATED:")
    assert isinstance(fine, Done) and len(tokens) == 4


@pytest.mark.slow
def test_a_recovery_that_outlasts_the_request_is_a_504(model):
    async def scenario(cluster: ModelManager):
        replan = asyncio.create_task(cluster.main.recover("test: a new plan", always=True))
        for _ in range(1000):  # recover() takes the cluster out of service first
            if not cluster.main.ready:
                break
            await asyncio.sleep(0.01)
        assert not cluster.main.ready
        ended = await run_request(cluster, long_request(4), GatewaySettings(
            request_timeout=0.05, keepalive_seconds=0.1))
        await replan
        after = await run_request(cluster, long_request(4), GatewaySettings())
        return ended, after, cluster.main.epoch

    (tokens, ended), (_, after), epoch = serve(model, scenario)
    assert isinstance(ended, APIError) and ended.status == 504 and not tokens
    assert "ran past the server's time limit while the model loaded or the cluster recovered" \
        in ended.message
    assert isinstance(after, Done) and epoch == 2


@pytest.mark.slow
def test_a_request_whose_plans_keep_changing_gives_up(model):
    """Every attempt's worker is stopped for a new plan: each is resumed (a clean stop is never
    the request's fault), until MAX_ATTEMPTS: a 503 that says so."""
    async def scenario(cluster: ModelManager):
        replans: list[asyncio.Task] = []
        ended = await run_request(cluster, long_request(), GatewaySettings(), lambda c: (
            replans.append(asyncio.create_task(c.main.recover("test: a new plan", always=True)))))
        await asyncio.gather(*replans)
        return ended

    tokens, ended = serve(model, scenario)
    assert isinstance(ended, APIError) and ended.status == 503, ended
    assert ended.message == (f"lost the node {MAX_ATTEMPTS} times; last: the node is shutting "
                             "down")
    assert len(tokens) >= MAX_ATTEMPTS


@pytest.mark.slow
def test_a_request_that_breaks_two_plans_is_not_run_again(model):
    """Its worker dies under it (SIGKILL), and again on the plan that replaced it: the request
    is refused with its own error, and the cluster, re-planned, serves the next one."""
    async def scenario(cluster: ModelManager):
        ended = await run_request(cluster, long_request(), GatewaySettings(),
                                  lambda c: os.kill(head_worker(c), signal.SIGKILL))
        epoch = cluster.main.epoch
        after = await run_request(cluster, long_request(8), GatewaySettings())
        return ended, epoch, after, cluster.main.epoch

    (tokens, ended), epoch, (_, after), final = serve(model, scenario)
    assert isinstance(ended, APIError) and ended.status == 500, ended
    assert ended.code == "request_failed_node"
    assert ended.message.startswith("the node went down under this request on two plans")
    assert "UNAVAILABLE" in ended.message
    assert tokens and epoch == 2
    assert isinstance(after, Done) and final == 3


@pytest.mark.slow
def test_a_hung_worker_ends_the_stream_with_a_504_mid_stream_and_in_a_reply(model, tmp_path):
    """The head worker stops (SIGSTOP) after the first tokens: the request's time limit passes,
    and the error arrives as an SSE event after those tokens, or as the non-streaming reply."""
    with start_server(model, "--request-timeout", "2", home=tmp_path / "h",
                      keepalive=None) as server:
        worker = httpx.get(server.url + "/health", timeout=10).json()["nodes"][0]["worker_pid"]
        body = {"model": server.model_id, "prompt": [5, 6, 7], "max_tokens": 1800,
                "temperature": 0, "ignore_eos": True}
        events = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={**body, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 2:
                            os.kill(worker, signal.SIGSTOP)
                    elif line == "data: [DONE]":
                        events.append(line)
            os.kill(worker, signal.SIGCONT)
            os.kill(worker, signal.SIGSTOP)
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert events[-1] == "data: [DONE]"
        error = events[-2]["error"]
        assert error["message"] == "the request ran past the server's time limit"
        assert error["code"] == "timeout"
        assert "".join(e["choices"][0]["text"] for e in events[:-2] if e["choices"])
        assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout"
        # The worker, running again, serves the next request.
        ok = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200, ok.text


# ---- a node without disk room, the weight store's refusals, a disk that fills ----------------

def tmpfs_agent(home: Path, size: str, name: str):
    """A node agent whose store is a tmpfs of `size` in its own mount namespace."""
    if why := _can_mount():
        pytest.skip(why)
    models = home / "models"
    models.mkdir(parents=True)
    prefix = ("unshare", "-m", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs -o size=$1 tmpfs "$0" && shift && exec "$@"', str(models), size)
    return agent_process(home, name, cmd_prefix=prefix)


@pytest.mark.slow
def test_a_node_without_disk_room_is_left_out_of_the_plan(big, tmp_path):
    """mac-b's store cannot take a single layer (beyond the margin it keeps free): the plan
    that would split the model over both is refused there, and the cluster serves on mac-a."""
    with agent_process(tmp_path / "a", "mac-a") as (_, a), \
            tmpfs_agent(tmp_path / "b", "70m", "mac-b") as (_, b):
        async def main():
            manager = serving(big, "wide-fp", ClusterOptions(nodes=0, secret=SECRET,
                                                             os_reserve_bytes=0))
            await manager.start()
            cluster = manager.cluster
            try:
                await cluster.add_remote(a, "mac-a")
                await cluster.add_remote(b, "mac-b")
                done = await run_request(manager, long_request(4), GatewaySettings())
                return manager.main.ready, manager.main.plan, cluster.nodes, done
            finally:
                await manager.stop()

        ready, plan, nodes, (tokens, done) = asyncio.run(main())
    assert ready and [s.node for s in plan.stages] == ["mac-a"]
    by_id = {n["id"]: n for n in nodes}
    assert "not enough disk space on this node for wide-fp" in by_id["mac-b"]["weights_error"]
    assert by_id["mac-b"]["workers"] == []
    assert [w["layers"] for w in by_id["mac-a"]["workers"]] == [[0, 4]]
    assert isinstance(done, Done) and len(tokens) == 4


def _manifest(source: WeightSource) -> pb.WeightManifest:
    return source.manifest(0, 1, source.files_for(0, 1))


def _tensor_file(m: pb.WeightManifest) -> pb.WeightFile:
    return next(f for f in m.files if f.safetensors)


def _raw_file(m: pb.WeightManifest) -> pb.WeightFile:
    return next(f for f in m.files if not f.safetensors)


BAD_MANIFESTS = {
    "fingerprint": (lambda m: setattr(m, "fingerprint", "XYZ"),
                    "fingerprint 'XYZ' is not a sha256 hex digest"),
    "model id": (lambda m: setattr(m, "model_id", ".."), "model id '..' names no folder"),
    "range": (lambda m: (setattr(m, "layer_start", 3), setattr(m, "layer_end", 2)),
              "layer range [3, 2) is not inside 4 layers"),
    "part": (lambda m: setattr(m.files[0], "name", "model-layer-00000.safetensors.part"),
             "is not allowed"),
    "record": (lambda m: setattr(_raw_file(m), "name", "shard.json"),
               "file name 'shard.json' is not allowed"),
    "twice": (lambda m: m.files.append(m.files[0]), "appears twice"),
    "raw weights": (lambda m: setattr(_tensor_file(m), "safetensors", False),
                    "only model*.safetensors files carry tensors"),
    "nameless": (lambda m: setattr(_tensor_file(m).tensors[0], "name", ""),
                 "tensor names must be present and distinct"),
    "dtype": (lambda m: setattr(_tensor_file(m).tensors[0], "dtype", "Q4"), "cannot take"),
    "bytes": (lambda m: setattr(_tensor_file(m).tensors[0], "nbytes",
                                _tensor_file(m).tensors[0].nbytes + 4), "cannot take"),
    "sum": (lambda m: setattr(_tensor_file(m), "size", _tensor_file(m).size + 1),
            "its tensors do not add up to"),
    "raw tensors": (lambda m: _raw_file(m).tensors.append(_tensor_file(m).tensors[0]),
                    "lists tensors"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_a_bad_manifest_is_refused_and_nothing_is_written(model, tmp_path, case):
    source = WeightSource(model, "tiny-fp")
    manifest = _manifest(source)
    spoil, message = BAD_MANIFESTS[case]
    spoil(manifest)
    store = WeightStore(tmp_path / "models")
    with pytest.raises(WeightError) as err:
        store.prepare(manifest)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith("bad weight manifest: ") and message in str(err.value)
    assert not (tmp_path / "models").exists()
    assert store.prepare(_manifest(source)).files  # the store still takes a good one


@pytest.mark.slow
def test_a_disk_that_fills_mid_write_aborts_and_the_transfer_resumes(big, tmp_path):
    """The store had room when it prepared; then something else fills its disk (a file written
    into the agent's tmpfs through its mount namespace). The write fails with ENOSPC:
    RESOURCE_EXHAUSTED, the part kept; once space is back the transfer resumes from it."""
    source = WeightSource(big, "wide-fp")
    files = source.files_for(1, 2)
    layer = files[0]
    size = f"{(FREE_SPACE_MARGIN_BYTES >> 20) + 24}m"  # the margin and one 9.4 MB layer fit
    with tmpfs_agent(tmp_path / "home", size, "mac") as (proc, address):
        inside = Path(f"/proc/{proc.pid}/root{tmp_path}")  # the agent's mounts, seen from here
        models = inside / "home" / "models"

        async def main():
            agent = await admitted(address)
            try:
                await agent.prepare_weights(source.manifest(1, 2, files))
                first = await push(agent, [chunk(source.fingerprint, layer, 0)])
                st = os.statvfs(models)
                (models / "filler").write_bytes(bytes(st.f_bavail * st.f_frsize - (64 << 10)))
                with pytest.raises(grpc.aio.AioRpcError) as err:  # 1 MiB into 64 KiB
                    await push(agent, [chunk(source.fingerprint, layer, 1 << 20)])
                (models / "filler").unlink()
                resumed = await ensure_weights(agent, source, 1, 2)
                return first, err.value, resumed
            finally:
                await agent.close()

        first, err, resumed = asyncio.run(main())
        assert proc.alive()
        assert_holds_exactly(Path(f"/proc/{proc.pid}/root{resumed.local_path}"), files)
    assert first == []  # under the first ack's 4 MiB: nothing acked, the bytes are in the part
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "this node could not write the weights" in err.details()
    assert "No space left on device" in err.details()
    assert 1 << 20 <= resumed.bytes_total - resumed.bytes_sent < resumed.bytes_total


# ---- the KV writer's dropped writes ------------------------------------------------------------

def _store_blocks(pc: PrefixCache, seed: int, n_blocks: int = 3) -> list[int]:
    tokens = list(range(seed, seed + n_blocks * BS))
    pc.store(tokens, synthetic_cache(pc.n_layers, len(tokens), seed))
    return tokens


def test_kv_writer_drops_what_its_queue_cannot_hold(tmp_path):
    """A queue smaller than one block: every SSD write is dropped at once (the engine never
    waits for the writer), and the blocks are served from RAM all the same."""
    with make_pc(tmp_path / "ssd", write_queue_max_bytes=1) as pc:
        tokens = _store_blocks(pc, 1)
        assert pc.flush(10)
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="queue_full") == 3
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="ok") == 0
        assert files(pc) == [] and pc.lookup(tokens) == len(tokens)


def test_kv_writer_skips_a_block_larger_than_the_ssd_tier(tmp_path):
    with make_pc(tmp_path / "ssd", ssd_max_bytes=1024) as pc:
        tokens = _store_blocks(pc, 2)
        assert pc.flush(10)
        assert metric(pc, "omlx_node_kv_cache_ssd_writes_total", result="too_large") == 3
        assert files(pc) == [] and pc.lookup(tokens) == len(tokens)
    with make_pc(tmp_path / "ssd") as pc:  # written nothing: a restart finds nothing
        assert pc.lookup(tokens) == 0
