"""Weight transfer to nodes that lack the model: real node agents (each with its own store) over
loopback gRPC, real breaks (a cancelled stream, a SIGKILLed agent), real corruption on disk."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import zlib
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from prometheus_client import generate_latest

from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.nodes.weight_transfer import WeightSource, ensure_weights
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_node.stage import StageError, StageRunner
from omlx_node.weight_store import ACK_EVERY_BYTES, CHUNK_MAX_BYTES
from omlx_shared.child import omlx_command
from omlx_shared.model_spec import resolve_model
from omlx_shared.model_store import ModelError, list_models
from omlx_shared.safetensors_header import read_header
from proto import omlx_pb2 as pb
from tests.cluster_secret import SECRET
from tests.conftest import parse_metrics
from tests.helpers.weights import (
    _can_mount,
    admitted,
    agent_process,
    assert_holds_exactly,
    chunk,
    push,
)
from tests.tiny_models import build_model, serving, truncated_model

pytestmark = pytest.mark.slow  # real node agents receiving weights


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """4 layers of a few hundred KB: for pipelines."""
    return build_model(tmp_path_factory.mktemp("wt") / "tiny-wt", "llama", num_layers=4)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """4 layers of 9.4 MB each (float32, hidden 512): a transfer spans several acks."""
    return build_model(tmp_path_factory.mktemp("wt") / "wide-wt", "llama", num_layers=4,
                       hidden_size=512)


def run(coro):
    return asyncio.run(coro)


def layer_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def test_a_node_receives_only_its_range_and_keeps_it(small, tmp_path, monkeypatch):
    source = WeightSource(small, "tiny-wt")
    with agent_process(tmp_path / "home") as (_, address):
        async def main():
            agent = await admitted(address)
            first = await ensure_weights(agent, source, 1, 3)
            again = await ensure_weights(agent, source, 1, 3)
            moved = await ensure_weights(agent, source, 2, 4)
            await agent.close()
            return first, again, moved

        first, again, moved = run(main())
    folder = Path(first.local_path)
    assert folder == tmp_path / "home" / "models" / f"tiny-wt@{source.fingerprint[:12]}"
    files = source.files_for(1, 3)
    raw = [f for f in files if not f.safetensors]
    assert {f.name for f in raw} >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert [f.name for f in files if f.safetensors] == [
        "model-layer-00001.safetensors", "model-layer-00002.safetensors"]
    # Exactly the range's tensors plus the small files, nothing else.
    layout_bytes = sum(t.nbytes for f in files if f.safetensors for t in f.tensors)
    assert first.bytes_sent == first.bytes_total == layout_bytes + sum(f.size for f in raw)
    assert not first.full_copy and first.attempts == 1
    assert set(first.files_sent) == {f.name for f in files}
    assert again.bytes_sent == 0 and again.local_path == first.local_path
    # A moved range: only the new layer and the last stage's norm and head travel.
    new = [f for f in source.files_for(2, 4) if f.name in
           ("model-layer-00003.safetensors", "model-norm.safetensors", "model-head.safetensors")]
    assert moved.bytes_sent == sum(f.size for f in new)
    assert layer_files(folder) == ["model-head.safetensors", "model-layer-00001.safetensors",
                                   "model-layer-00002.safetensors",
                                   "model-layer-00003.safetensors", "model-norm.safetensors"]
    assert_holds_exactly(folder, source.files_for(1, 4))
    # Weights may be a private fine-tune: folder 0700, every file (the shard record too) 0600.
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in [folder, *folder.iterdir()]} == {
        p.name: "0o700" if p.is_dir() else "0o600" for p in [folder, *folder.iterdir()]}

    # The store lists the shard; it is never served as a model of its own.
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    [info] = list_models()
    assert (info.name, info.shard) == (folder.name, "layers 1-3 of 4")
    listed = subprocess.run(omlx_command("models", "list"), capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert "shard: layers 1-3 of 4" in listed.stdout, listed.stdout + listed.stderr
    with pytest.raises(ModelError, match="holds only part of tiny-wt"):
        resolve_model(folder.name)

    # Loaded from the shard folder, a stage computes what it computes from the whole model.
    whole, part = StageRunner(small, 1, 4), StageRunner(folder, 1, 4)
    h = mx.random.normal((1, 5, whole.hidden_size))
    assert mx.array_equal(whole(h, whole.make_cache()), part(h, part.make_cache())).item()
    # A range whose weights the folder lacks is refused, never run on random weights.
    with pytest.raises(StageError, match=r"lacks weights of layers \[0, 2\).*layers \[0\], "
                                         r"embed_tokens"):
        StageRunner(folder, 0, 2)


def test_tied_embeddings_travel_to_the_last_stage(tmp_path):
    model = build_model(tmp_path / "tied", "qwen3", num_layers=3)
    source = WeightSource(model, "tied")
    assert source.tied
    assert [f.name for f in source.files_for(2, 3) if f.safetensors] == [
        "model-layer-00002.safetensors", "model-embed.safetensors", "model-norm.safetensors"]
    assert [f.name for f in source.files_for(0, 1) if f.safetensors] == [
        "model-layer-00000.safetensors", "model-embed.safetensors"]
    with agent_process(tmp_path / "home") as (_, address):
        async def main():
            agent = await admitted(address)
            try:
                return await ensure_weights(agent, source, 2, 3)
            finally:
                await agent.close()

        result = run(main())
    whole, part = StageRunner(model, 2, 3), StageRunner(result.local_path, 2, 3)
    h = mx.random.normal((1, 4, whole.hidden_size))
    assert mx.array_equal(whole(h, whole.make_cache()), part(h, part.make_cache())).item()


def test_pipeline_of_joined_nodes_matches_mlx_lm(small, tmp_path):
    ref_model, tok = load(str(small))
    prompt = tok.encode("The capital of France is")
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=16)]
    source = WeightSource(small, "tiny-wt")
    with agent_process(tmp_path / "a", "mac-a") as (_, a), \
            agent_process(tmp_path / "b", "mac-b") as (_, b):
        async def main():
            manager = serving(small, "tiny-wt", ClusterOptions(nodes=0, secret=SECRET,
                                                               os_reserve_bytes=0))
            await manager.start()
            cluster = manager.cluster
            try:
                await cluster.add_remote(a, "mac-a")  # mac-a alone: it receives the whole model
                whole = manager.weight_counters.bytes_sent
                await cluster.add_remote(b, "mac-b")  # the split: mac-b receives only its range
                assert manager.main.ready, manager.main.status
                layers = manager.main.stages_on()
                call = manager.main.node.generate(pb.GenerateRequest(
                    request_id="r", prompt_tokens=prompt, max_tokens=16), timeout=60)
                tokens = [t async for chunk in call for t in chunk.tokens]
                counters = manager.weight_counters
                return whole, counters.bytes_sent - whole, layers, tokens, counters
            finally:
                await manager.stop()

        whole, second, layers, tokens, counters = run(main())
    assert tokens == reference
    assert whole == sum(f.size for f in source.files_for(0, 4))
    exported = parse_metrics(generate_latest(GatewayMetrics(counters).registry).decode())
    assert exported["omlx_weight_bytes_sent_total"] == whole + second
    lower, upper = sorted([layers["mac-a"], layers["mac-b"]])  # two stages tile the model
    assert lower[0] == 0 and lower[1] == upper[0] and upper[1] == 4
    start, end = layers["mac-b"]
    # mac-a already held everything; mac-b got its range and nothing more.
    assert second == sum(f.size for f in source.files_for(start, end))
    b_folder = tmp_path / "b" / "models" / f"tiny-wt@{source.fingerprint[:12]}"
    assert_holds_exactly(b_folder, source.files_for(start, end))


def test_a_remote_head_receives_the_draft_model_and_drafts_with_it(small, tmp_path):
    """A model whose draft (`speculative = "draft=PATH"`) only the coordinator holds, over two
    joined nodes: the head receives the draft's files as it receives its layers, into its own
    store, drafts with them in the pipeline, and the output is mlx-lm's."""
    draft = truncated_model(small, tmp_path / "draft", 3)  # the same tokenizer, fewer layers
    ref_model, tok = load(str(small))
    prompt = tok.encode("one two three one two three one two three one two")
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=24)]
    with agent_process(tmp_path / "a", "mac-a") as (_, a), \
            agent_process(tmp_path / "b", "mac-b") as (_, b):
        async def main():
            manager = serving(small, "tiny-wt", ClusterOptions(nodes=0, secret=SECRET,
                                                               os_reserve_bytes=0),
                              speculative=f"draft={draft}")
            await manager.start()
            cluster = manager.cluster
            try:
                await cluster.add_remote(a, "mac-a")
                await cluster.add_remote(b, "mac-b")
                assert manager.main.ready, manager.main.status
                layers = manager.main.stages_on()
                call = manager.main.node.generate(pb.GenerateRequest(
                    request_id="r", prompt_tokens=prompt, max_tokens=24, ignore_eos=True),
                    timeout=60)
                tokens = [t async for chunk in call for t in chunk.tokens]
                head = next(m for m in cluster.members if layers[m.name][0] == 0)
                deadline = asyncio.get_running_loop().time() + 30
                while True:  # the head worker's drafts, as its agent probes them
                    [worker] = (await head.agent.health()).workers
                    if worker.speculative_tokens_per_step or \
                            asyncio.get_running_loop().time() > deadline:
                        break
                    await asyncio.sleep(0.5)
                return tokens, head.name, len(layers), worker
            finally:
                await manager.stop()

        tokens, head, stages, worker = run(main())
    assert tokens == reference
    assert stages == 2
    assert worker.speculative_tokens_per_step >= 1, worker  # it drafted
    source = WeightSource(draft, "draft")
    home = tmp_path / ("a" if head == "mac-a" else "b")
    assert_holds_exactly(home / "models" / f"draft@{source.fingerprint[:12]}",
                         source.files_for(0, source.num_layers))


class Interrupt(Exception):
    pass


def test_cancelled_transfer_resumes(big, tmp_path):
    source = WeightSource(big, "wide-wt")
    total = sum(f.size for f in source.files_for(0, 4))
    with agent_process(tmp_path / "home") as (_, address):
        def stop_at_first_ack(progress):
            raise Interrupt(progress.bytes_sent)

        async def main():
            agent = await admitted(address)
            with pytest.raises(Interrupt):
                await ensure_weights(agent, source, 0, 4, on_progress=stop_at_first_ack)
            result = await ensure_weights(agent, source, 0, 4)
            await agent.close()
            return result

        result = run(main())
    # The first ack came after ACK_EVERY_BYTES written durably: those are not sent again.
    assert 0 < result.bytes_sent <= total - ACK_EVERY_BYTES
    assert result.bytes_total == total
    assert_holds_exactly(Path(result.local_path), source.files_for(0, 4))


def test_transfer_resumes_after_the_agent_is_killed(big, tmp_path):
    source = WeightSource(big, "wide-wt")
    total = sum(f.size for f in source.files_for(0, 3))
    home = tmp_path / "home"
    with agent_process(home) as (proc, address):
        def kill_at_first_ack(progress):
            os.kill(proc.pid, signal.SIGKILL)
            raise Interrupt()

        async def broken():
            agent = await admitted(address)
            try:
                await ensure_weights(agent, source, 0, 3, on_progress=kill_at_first_ack,
                                     attempts=1)
            finally:
                await agent.close()

        with pytest.raises(Interrupt):
            run(broken())
        proc.proc.wait(10)
    with agent_process(home) as (_, address):  # the same store, a new process
        async def resumed():
            agent = await admitted(address)
            try:
                return await ensure_weights(agent, source, 0, 3)
            finally:
                await agent.close()

        result = run(resumed())
    assert 0 < result.bytes_sent <= total - ACK_EVERY_BYTES
    assert_holds_exactly(Path(result.local_path), source.files_for(0, 3))


def test_a_corrupt_part_is_fetched_again(big, tmp_path):
    source = WeightSource(big, "wide-wt")
    files = source.files_for(1, 2)
    layer = files[0]
    assert layer.name == "model-layer-00001.safetensors" and layer.size > 3 * CHUNK_MAX_BYTES
    with agent_process(tmp_path / "home") as (_, address):
        async def main():
            agent = await admitted(address)
            try:
                needs = await agent.prepare_weights(source.manifest(1, 2, files))
                # A transfer that stops after two chunks: the node keeps them as a part.
                await push(agent, [chunk(source.fingerprint, layer, 0),
                                   chunk(source.fingerprint, layer, CHUNK_MAX_BYTES)])
                part = Path(needs.local_path) / f"{layer.name}.part"
                header = read_header(part).data_start
                assert part.stat().st_size == header + 2 * CHUNK_MAX_BYTES
                with open(part, "r+b") as f:  # the disk flips a byte of the held data
                    f.seek(header + 1000)
                    byte = f.read(1)
                    f.seek(header + 1000)
                    f.write(bytes([byte[0] ^ 0xFF]))
                return await ensure_weights(agent, source, 1, 2)
            finally:
                await agent.close()

        result = run(main())
    # The first attempt resumed, failed its sha256 check (the part was deleted), the second
    # sent the file whole. The small files that followed the layer file may have left before
    # the node's refusal came back: they count as sent, twice.
    raw = sum(f.size for f in files if not f.safetensors)
    assert result.attempts == 2
    expected = (layer.size - 2 * CHUNK_MAX_BYTES) + layer.size + raw
    assert expected <= result.bytes_sent <= expected + raw
    assert_holds_exactly(Path(result.local_path), files)


def test_a_node_with_its_own_copy_receives_nothing(small, tmp_path):
    source = WeightSource(small, "tiny-wt")
    home = tmp_path / "home"
    # Another model under the same name is not this one: it is never used for it.
    other = build_model(tmp_path / "other", "llama", num_layers=4, seed=1)
    shutil.copytree(other, home / "models" / "tiny-wt")
    with agent_process(home) as (_, address):
        async def transfer():
            agent = await admitted(address)
            try:
                return await ensure_weights(agent, source, 0, 2)
            finally:
                await agent.close()

        foreign = run(transfer())
        assert not foreign.full_copy and foreign.bytes_sent == foreign.bytes_total
        shutil.rmtree(home / "models")
        shutil.copytree(small, home / "models" / "tiny-wt")
        own = run(transfer())
    assert own.full_copy and own.bytes_sent == 0
    assert own.local_path == str(home / "models" / "tiny-wt")


def test_bad_chunks_get_clear_errors_and_the_agent_keeps_serving(small, tmp_path):
    source = WeightSource(small, "tiny-wt")
    files = source.files_for(0, 1)
    layer = files[0]
    fp = source.fingerprint
    with agent_process(tmp_path / "home") as (proc, address):
        async def main():
            agent = await admitted(address)
            errors = {}

            async def error(name: str, coro) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await coro
                errors[name] = (e.value.code(), e.value.details())

            await error("unprepared", push(agent, [chunk("f" * 64, layer, 0)]))
            bad = source.manifest(0, 1, files)
            bad.files[0].name = "../escape.safetensors"
            await error("manifest", agent.prepare_weights(bad))
            await agent.prepare_weights(source.manifest(0, 1, files))
            await error("crc", push(agent, [chunk(fp, layer, 0, 100, crc=1)]))
            await error("gap", push(agent, [chunk(fp, layer, 100, 100)]))
            await error("fingerprint", push(agent, [chunk(fp, layer, 0, 100),
                                                    chunk("e" * 64, layer, 100, 100)]))
            stranger = pb.WeightChunk(fingerprint=fp, file="model-layer-00009.safetensors",
                                      data=b"x", crc32=zlib.crc32(b"x"))
            await error("file", push(agent, [stranger]))
            health = await agent.health()
            result = await ensure_weights(agent, source, 0, 1)
            await agent.close()
            return errors, health, result

        errors, health, result = run(main())
        assert proc.alive()
    assert errors["unprepared"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "call PrepareWeights before PushWeights" in errors["unprepared"][1]
    assert errors["manifest"] == (grpc.StatusCode.INVALID_ARGUMENT,
                                  "bad weight manifest: file name '../escape.safetensors' is "
                                  "not allowed")
    assert errors["crc"][0] == grpc.StatusCode.DATA_LOSS and "crc32" in errors["crc"][1]
    assert errors["gap"][0] == grpc.StatusCode.OUT_OF_RANGE
    assert "chunk at offset 100, but this node holds 0 bytes" in errors["gap"][1]
    assert errors["fingerprint"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "in a transfer of" in errors["fingerprint"][1]
    assert errors["file"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "not in the prepared manifest" in errors["file"][1]
    assert health.version
    # The 100 bytes the fingerprint test wrote before its bad chunk are resumed from.
    assert result.bytes_sent == result.bytes_total - 100
    assert_holds_exactly(Path(result.local_path), files)


def test_a_node_without_disk_space_refuses_clearly(big, tmp_path):
    if why := _can_mount():
        pytest.skip(why)
    source = WeightSource(big, "wide-wt")
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    # The agent's store is a 96 MiB tmpfs in its own mount namespace: room for one 9.4 MB
    # layer but not four, with the 64 MiB the node keeps spare.
    prefix = ("unshare", "-m", "--propagation", "private", "sh", "-c",
              'mount -t tmpfs -o size=96m tmpfs "$0" && exec "$@"', str(models))
    with agent_process(tmp_path / "home", cmd_prefix=prefix) as (_, address):
        async def main():
            agent = await admitted(address)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ensure_weights(agent, source, 0, 4)
                small = await ensure_weights(agent, source, 3, 4)  # one layer fits
                return e.value, small
            finally:
                await agent.close()

        err, fits = run(main())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not enough disk space on this node for wide-wt layers [0, 4)" in err.details()
    assert f"wide-wt@{source.fingerprint[:12]}" in err.details()
    assert "free there" in err.details()
    assert fits.bytes_sent == fits.bytes_total
    assert not any(models.iterdir())  # the tmpfs went with the agent's namespace


def test_file_names_one_folder_down_and_no_further(tmp_path):
    """A module folder's file (`1_Pooling/config.json`) is a name the store takes; names that
    would climb out of the model's folder, or hide in a dot folder, are refused."""
    from omlx_node.weight_store import WeightError, WeightStore

    store = WeightStore(tmp_path / "models")

    def manifest(name: str) -> pb.WeightManifest:
        return pb.WeightManifest(model_id="m", fingerprint="ab" * 32, layer_start=0,
                                 layer_end=1, num_layers=1,
                                 files=[pb.WeightFile(name=name, size=2)])

    assert store.prepare(manifest("1_Pooling/config.json")).files[0].have_bytes == 0
    for bad in ("../config.json", "a/../../b", ".hidden/config.json", "a/b/c.json", "/etc/x",
                "1_Pooling/", "1_Pooling/model.safetensors"):
        with pytest.raises(WeightError, match="bad weight manifest"):
            store.prepare(manifest(bad))
