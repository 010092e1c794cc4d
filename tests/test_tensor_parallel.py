"""Tensor-parallel stages (omlx_node/tensor.py): ranks holding a slice of every layer, as
separate worker processes over mx.distributed's ring on loopback, against mlx-lm's own
generation on tiny random fp32 models: families split by mlx-lm's own `shard()` (dense, GQA, MoE,
MLA, gpt_oss's sliding-window MoE), families split by the generic sharder (gemma3_text and cohere2
sliding-window; mixtral, MoE), and 3 ranks over 4 heads and 2 KV heads (uneven, a KV head held by
two ranks), dense and MoE."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from mlx_lm import load
from openai import OpenAI

from omlx_shared.child import ChildError, omlx_command
from tests.conftest import free_port, start_server
from tests.helpers.pipeline import PROMPTS, generate, tensor_stage
from tests.helpers.tensor_reference import (TOKENS, assert_matches, assert_serves_like_mlx_lm,
                                            reference, shard_bytes)
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gemma3_text", "cohere2", "gpt_oss",
            "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tp") / request.param, request.param,
                       num_layers=3)


def test_tensor_stage_greedy_matches_mlx_lm(model):
    """One stream alone, then every prompt at once (continuous batching, chunked prefill of
    prompts longer than the 8-token chunk), with the prefix cache on."""
    check_stage(model, ranks=2)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])
def test_three_ranks_over_heads_that_do_not_divide(family, tmp_path):
    """4 query heads and 2 KV heads over 3 ranks: 2, 1 and 1 query heads, KV head 1 on ranks 1
    and 2 (the generic sharder's uneven split); qwen3_moe's experts 11, 11 and 10 wide; an
    untied head (llama's) split by a vocabulary of 386, 129, 129 and 128 rows, one padded."""
    model = build_model(tmp_path / family, family, num_layers=3, vocab_size=386)
    assert json.loads((model / "config.json").read_text())["vocab_size"] % 3 == 2
    check_stage(model, ranks=3)


def check_stage(model: Path, ranks: int) -> None:
    _, tok = load(str(model))
    refs = reference(model, PROMPTS)
    with tensor_stage(model, ranks, extra=("--hot-cache-max-size", "64MB")) as (stub, infos):
        # Each rank holds its slice of the layers: less than the whole model, more than its
        # share (the embedding and the head stay whole).
        whole = (model / "model.safetensors").stat().st_size
        for info in infos:
            held = shard_bytes(info["metrics_port"])
            assert whole / ranks < held < whole * 0.9, (held, whole)
        assert_serves_like_mlx_lm(stub, tok, refs)
        # A prompt seen before: its prefix comes from every rank's prefix cache.
        again, _ = generate(stub, tok.encode(PROMPTS[4]), TOKENS)
        assert_matches(again, refs[PROMPTS[4]], PROMPTS[4])


def test_heads_that_do_not_divide_are_refused(tmp_path):
    """3 ranks of gpt_oss, 4 attention heads with a sink each: mlx-lm's shard() splits evenly,
    and the uneven split serves only the common shape. Each rank exits, saying why."""
    path = build_model(tmp_path / "m", "gpt_oss", num_layers=2)
    with pytest.raises(ChildError) as err:
        with tensor_stage(path, ranks=3):
            pass
    assert "gpt_oss has 4 attention heads (num_attention_heads), which do not divide over 3 "\
           "ranks; mlx-lm's Model.shard() splits evenly" in str(err.value)


def test_gateway_serves_a_tensor_parallel_stage(tmp_path):
    """`serve --nodes 2 --parallel tensor`: the planner lays the model over both nodes as one
    tensor-parallel stage, status says so, and completions equal mlx-lm's."""
    model = build_model(tmp_path / "llama", "llama", num_layers=3)
    _, tok = load(str(model))
    ref = reference(model, [PROMPTS[0]])[PROMPTS[0]]
    with start_server(model, "--nodes", "2", "--parallel", "tensor", home=tmp_path / "h",
                      keepalive=None) as server:
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        assert status["parallel"] == "tensor x2 over ring"
        # Each rank's heads (4 heads, 2 KV heads: a KV head and its 2 query heads a rank).
        ranks = [{"rank": 0, "node": "local0", "q_heads": [0, 2], "kv_heads": [0]},
                 {"rank": 1, "node": "local1", "q_heads": [2, 4], "kv_heads": [1]}]
        assert status["ranks"] == ranks
        replica = status["models"][0]["replicas"][0]
        assert (replica["parallel"], replica["ranks"]) == ("tensor x2 over ring", ranks)
        shown = subprocess.run(omlx_command("status", "--url", server.url), capture_output=True,
                               text=True, timeout=60).stdout
        assert "parallel: tensor x2 over ring" in shown, shown
        assert "rank 1 local1: q heads [2, 4), KV heads [1, 2)" in shown, shown
        assert [(s["layer_start"], s["layer_end"]) for s in status["plan"]["stages"]] == [
            (0, 3), (0, 3)]
        client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model=server.model_id, prompt=tok.encode(PROMPTS[0]),
                                      max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        # (This prompt's greedy tokens have no near-tie in mlx-lm's logits: exact.)
        assert r.choices[0].text == tok.decode([t for t, _, _ in ref])


def test_gateway_refuses_tensor_for_heads_that_do_not_divide(tmp_path):
    model = build_model(tmp_path / "gpt_oss", "gpt_oss", num_layers=2)
    r = subprocess.run(omlx_command("serve", "--model", str(model), "--port", str(free_port()),
                                    "--nodes", "3", "--parallel", "tensor"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert ("cannot run tensor-parallel over 3 nodes: gpt_oss has 4 attention heads "
            "(num_attention_heads), which do not divide over 3 ranks") in r.stderr
