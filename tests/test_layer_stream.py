"""Layers kept on disk and read just ahead of their turn (omlx_node/layer_stream.py): the same
greedy tokens as mlx-lm with some or nearly all layers streamed, a footprint that stays below
the whole model while it decodes (measured from outside the process), and a weights file that
goes away mid-serving is an error for that step, never a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load
from transformers import AutoTokenizer

from omlx_coordinator.planning.model_layout import read_layout
from omlx_node.batcher import Batcher
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageError, StageRunner
from tests.helpers.engine import drain
from tests.tiny_models import build_model

REPO = Path(__file__).resolve().parent.parent
PROMPT = [1, 5, 9, 13, 2, 7, 3, 3, 8, 11, 40, 2]


def greedy(stage: StageRunner, n: int = 10) -> list[int]:
    cache = stage.make_cache()
    x, out = mx.array([PROMPT]), []
    for _ in range(n):
        logits = stage(x, cache, last_only=True)
        out.append(int(mx.argmax(logits[0, -1]).item()))
        x = mx.array([[out[-1]]])
    return out


def reference(path: Path, n: int = 10) -> list[int]:
    model, _ = load(str(path))
    if mx.default_device() == mx.cpu:  # as the stage computes on a CPU
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.mark.parametrize("family,bits", [("llama", None), ("qwen3_moe", None),
                                         ("gemma3_text", None), ("llama", 4), ("qwen3_moe", 4)])
def test_streamed_layers_give_mlx_lms_tokens(tmp_path: Path, family: str, bits: int | None):
    # gemma3's sanitize drops the model's head when it sees no head weight: streaming must
    # never call it on the model being served.
    path = build_model(tmp_path / family, family=family, num_layers=6, quantize_bits=bits)
    want = reference(path)
    for streamed in (2, 3, 5):  # a third, half, all but one
        stage = StageRunner(path, streamed=streamed)
        assert stage.streamed_layers == streamed
        assert greedy(stage) == want, f"{streamed} of 6 layers streamed"


def test_a_later_stage_streams_its_own_last_layers(tmp_path: Path):
    path = build_model(tmp_path / "m", num_layers=6)
    whole = StageRunner(path)
    first, second = StageRunner(path, 0, 3, streamed=1), StageRunner(path, 3, 6, streamed=2)
    assert second.nbytes() < StageRunner(path, 3, 6).nbytes()
    c0, c1 = first.make_cache(), second.make_cache()
    x = mx.array([PROMPT])
    got = second(first(x, c0), c1)
    assert mx.allclose(got, whole(x, whole.make_cache()), atol=1e-5).item()


def _rchar() -> int:
    """Bytes this process has read through read(2)/pread(2), as the kernel counts them."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.parametrize("bits", [None, 4])
def test_a_streamed_moe_layer_reads_only_its_routed_experts(tmp_path: Path, bits: int | None):
    # 16 experts, 2 a token, wide enough that the experts are most of a layer.
    path = build_model(tmp_path / "moe", family="qwen3_moe", num_layers=4, quantize_bits=bits,
                       extra_config={"num_experts": 16, "moe_intermediate_size": 128})
    stage = StageRunner(path, streamed=3)
    whole = StageRunner(path).nbytes() - stage.nbytes()  # the streamed layers' weights
    planned = sum(read_layout(path).read_bytes(i) for i in (1, 2, 3))
    assert greedy(stage) == reference(path)
    cache = stage.make_cache()
    stage(mx.array([PROMPT]), cache)
    kernel = Path("/proc/self/io").exists()
    for token in (5, 9, 40):  # decode steps at batch 1: 2 of 16 experts a layer
        seen, counted = _rchar() if kernel else 0, stage.streamed_bytes_read
        mx.eval(stage(mx.array([[token]]), cache))
        counted = stage.streamed_bytes_read - counted
        assert 0 < counted < whole / 4, (counted, whole)
        assert counted == planned  # the planner's read estimate at batch 1, to the byte
        if kernel:  # what the kernel saw this process read, the files' headers included
            seen = _rchar() - seen
            assert counted <= seen < counted + (64 << 10), (seen, counted)
    # Rows that route apart read the union of their experts: more, never more than all.
    before = stage.streamed_bytes_read
    mx.eval(stage(mx.array([[t] for t in range(1, 33)]), stage.make_cache()))
    assert counted < stage.streamed_bytes_read - before <= whole


def test_experts_stored_one_tensor_each_are_read_whole(tmp_path: Path):
    # Hugging Face's layout: qwen3_moe's sanitize stacks experts.E.* at load; a streamed layer
    # then reads all of them, and the planner counts it so.
    path = build_model(tmp_path / "moe", family="qwen3_moe", num_layers=4)
    weights = mx.load(str(path / "model.safetensors"))
    for name in [k for k in weights if ".switch_mlp." in k]:
        stacked = weights.pop(name)
        for e in range(stacked.shape[0]):
            weights[name.replace(".switch_mlp.", f".experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    lay = read_layout(path)
    assert lay.read_bytes(3) == lay.layer_bytes[3] > lay.stream_bytes(3)
    stage = StageRunner(path, streamed=2)
    assert greedy(stage) == reference(path)
    before = stage.streamed_bytes_read
    mx.eval(stage(mx.array([[5]]), stage.make_cache()))
    assert stage.streamed_bytes_read - before == lay.layer_bytes[2] + lay.layer_bytes[3]


def test_every_layer_on_disk_is_refused(tmp_path: Path):
    path = build_model(tmp_path / "m", num_layers=4)
    with pytest.raises(StageError, match="at least one layer of a stage stays in memory"):
        StageRunner(path, 0, 2, streamed=2)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_weights_file_gone_mid_serving_fails_the_step(tmp_path: Path, family: str):
    path = build_model(tmp_path / "m", family=family, num_layers=4)
    stage = StageRunner(path, streamed=2)
    assert len(greedy(stage, 2)) == 2
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])  # truncated
    with pytest.raises((OSError, RuntimeError, ValueError)):
        greedy(stage, 2)


def test_an_engine_whose_weights_vanish_fails_its_requests_and_stops(tmp_path: Path):
    # Its worker then exits, and the coordinator re-plans (sending the layers again).
    path = build_model(tmp_path / "m", num_layers=4)
    batcher = Batcher(StageRunner(path, streamed=2), NodeMetrics())
    (path / "model.safetensors").unlink()
    seq = batcher.submit(SeqRequest("r", PROMPT, 8))
    (tokens, finish), = drain(batcher, [seq], max_steps=50)
    assert finish is not None and finish.reason != "length", finish
    assert batcher.status.startswith("failed: the engine cannot compute")


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except ProcessLookupError:  # it has just exited
        pass
    return 0


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's PSS")
def test_footprint_stays_under_the_resident_part_while_decoding(tmp_path: Path):
    # ~35 MiB a layer in fp32: 8 layers are far more than what the interpreter and MLX take.
    path = build_model(tmp_path / "m", num_layers=8, hidden_size=1024, vocab_size=384,
                       extra_config={"intermediate_size": 2816})
    layer = (path / "model.safetensors").stat().st_size // 8
    script = textwrap.dedent(f"""
        import sys, mlx.core as mx
        from omlx_node.stage import StageRunner
        stage = StageRunner({str(path)!r}, streamed=int(sys.argv[1]))
        cache = stage.make_cache()
        x = mx.array([[1, 2, 3]])
        print("loaded", flush=True)
        sys.stdin.readline()
        for _ in range(24):
            x = mx.argmax(stage(x, cache, last_only=True)[:, -1:], axis=-1)
            mx.eval(x)
        print("done", flush=True)
    """)

    def peak(streamed: int) -> tuple[int, int]:
        proc = subprocess.Popen([sys.executable, "-c", script, str(streamed)], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            assert proc.stdout.readline().strip() == "loaded"
            loaded = _pss_kib(proc.pid)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            top, deadline = loaded, time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                top = max(top, _pss_kib(proc.pid))
                time.sleep(0.01)
            assert proc.wait(timeout=5) == 0
            return loaded * 1024, top * 1024
        finally:
            proc.kill()

    _, all_resident = peak(0)
    loaded, streaming = peak(6)
    # Six of eight layers on disk: decoding holds the two resident ones, the streamed one in
    # use and the last one's buffers (in MLX's cache, for the next to reuse): four layers less
    # than all resident, never more than two above what it held once loaded.
    assert streaming < all_resident - 3.5 * layer, (streaming, all_resident, layer)
    assert streaming < loaded + 2 * layer, (streaming, loaded, layer)


@pytest.mark.slow
def test_serve_with_weights_memory_streams_and_answers_as_mlx_lm(
        tiny_model_path: Path, tmp_path: Path):
    from tests.conftest import start_server

    total = read_layout(tiny_model_path).total_weight_bytes
    want = reference(tiny_model_path, 12)
    with start_server(tiny_model_path, "--weights-memory", f"{total - 1}B",
                      home=tmp_path / "home") as server:
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        text = json.dumps(status)
        assert "stream from its SSD" in text and '"streamed_layers": 3' in text, text[:2000]
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": server.model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    head = tok.decode(PROMPT, skip_special_tokens=True)
    assert head + r.json()["choices"][0]["text"] == tok.decode(PROMPT + want,
                                                                skip_special_tokens=True)
