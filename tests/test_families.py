"""Every model family mlx-lm runs, served by the generic stage runner (omlx_node/families.py):
greedy tokens identical to mlx-lm's own single-sequence generation (`generate_step`) in one
node, split into two uneven stages, with 8 concurrent streams, and after a prefix-cache restore;
a family no stage can serve is refused at plan time with its name and the reason.

The models are tiny random ones built from mlx-lm's own classes (tests/tiny_models.py): MoE
(qwen3_moe, mixtral, glm4_moe), MLA + MoE (deepseek_v3), sliding-window attention (gemma3_text,
cohere2; gpt_oss with MoE too), hybrid linear attention (qwen3_next) and the long tail (phi3,
olmo2, granite). Most run in this process; two run as live two-stage pipelines of worker
processes over mx.distributed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from safetensors.numpy import save_file

from omlx_coordinator.planning.model_layout import read_layout
from omlx_coordinator.planning.planner import GiB, NodeSpec, make_plan
from omlx_node.batcher import Batcher
from omlx_node.families import FamilyError, check_shape, find_anatomy
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import Finish, SeqRequest
from omlx_node.stage import StageError, StageRunner
from omlx_node.stage_state import StageState
from omlx_node.worker import block_layout
from proto import omlx_pb2 as pb
from tests.conftest import parse_metrics
from tests.tiny_models import build_model

FAMILIES = ["qwen3_moe", "gpt_oss", "glm4_moe", "deepseek_v3", "gemma3_text", "qwen3_next",
            "phi3", "olmo2", "granite", "cohere2", "mixtral"]
# The prefix cache serves families whose layers keep per-token keys and values: full attention
# (MLA included) and sliding windows. A linear-attention state is not cut into blocks: the stage
# turns the cache off for qwen3_next, saying why.
PREFIX_OFF = {"qwen3_next"}
SLIDING = {"gpt_oss", "gemma3_text", "cohere2"}  # windows of 8 tokens
LAYERS = 4
PROMPTS = [
    "The capital of France is",
    "Hello",
    "x",
    "def add(a, b):\n    return",
    "A pipeline splits the layers of a model across several machines. " * 3,
    "Numbers: 0 1 2 3",
    "Large language models predict",
    "How are you today?",
]
# Different lengths, so rows leave the batch at different steps (filter, then extract).
MAX_TOKENS = [6 + (3 * i) % 9 for i in range(len(PROMPTS))]
LONG = PROMPTS[4]
BRANCH = LONG + "Then one more sentence."  # shares LONG's blocks


@dataclass
class Tiny:
    family: str
    path: Path
    prompts: list[list[int]]
    refs: list[list[int]]  # mlx-lm's greedy tokens for each prompt, MAX_TOKENS of them
    branch: list[int]
    branch_ref: list[int]


def reference(model, ids: list[int], n: int) -> list[int]:
    out = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    mx.synchronize()
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory) -> Tiny:
    path = build_model(tmp_path_factory.mktemp(request.param) / request.param, request.param,
                       num_layers=LAYERS)
    model, tok = load(str(path))
    prompts = [tok.encode(p) for p in PROMPTS]
    branch = tok.encode(BRANCH)
    return Tiny(request.param, path, prompts,
                [reference(model, p, n) for p, n in zip(prompts, MAX_TOKENS)],
                branch, reference(model, branch, 8))


class TwoStages:
    """Two StageRunners of one model as one stage: the single-node batcher drives both, so
    every cache operation of a pipeline (merge, extend, filter, extract) runs on each stage's
    own slice of layers, with that slice's masks, exactly as in a pipeline's stages."""

    def __init__(self, first: StageRunner, second: StageRunner):
        self.first, self.second = first, second
        self.info = replace(first.info, layer_end=second.info.layer_end)
        self.embed_tokens = first.embed_tokens
        # What speculative decoding's cost probe reads (one layer's MLP): the first stage's.
        self.feed_forward, self.hidden_size = first.feed_forward, first.hidden_size
        self.trimmable = first.trimmable  # decided from every layer: both stages agree

    @property
    def streamed_seconds(self) -> float:
        return self.first.streamed_seconds + self.second.streamed_seconds

    def make_cache(self) -> list:
        return self.first.make_cache() + self.second.make_cache()

    def __call__(self, x: mx.array, cache: list, last_only: bool = False) -> mx.array:
        n = len(self.first.layers)
        return self.second(self.first(x, cache[:n]), cache[n:], last_only)


def drain(batcher: Batcher, seqs) -> list[list[int]]:
    for _ in range(10_000):
        if batcher.idle:
            break
        batcher.step()
    out = []
    for s in seqs:
        events = []
        while not s.events.empty():
            events.append(s.events.get_nowait())
        assert isinstance(events[-1], Finish) and events[-1].reason == "length", events[-1]
        out.append(events[:-1])
    return out


def run_streams(batcher: Batcher, tiny: Tiny) -> list[list[int]]:
    """One stream alone, then all 8 at once (admitted together, prefilled in small chunks)."""
    alone = drain(batcher, [batcher.submit(SeqRequest("alone", tiny.prompts[4], MAX_TOKENS[4]))])
    assert alone[0] == tiny.refs[4]
    seqs = [batcher.submit(SeqRequest(str(i), p, n))
            for i, (p, n) in enumerate(zip(tiny.prompts, MAX_TOKENS))]
    return drain(batcher, seqs)


def test_one_node_8_streams_match_mlx_lm(tiny):
    batcher = Batcher(StageRunner(tiny.path), NodeMetrics(), prefill_chunk=5)
    assert run_streams(batcher, tiny) == tiny.refs


def test_uneven_two_stage_split_matches_mlx_lm(tiny):
    first, second = StageRunner(tiny.path, 0, 1), StageRunner(tiny.path, 1, LAYERS)
    assert len(first.layers) == 1 and len(second.layers) == LAYERS - 1
    assert first.norm is None and second.norm is not None
    # The planner's bytes (from the headers: experts, tied heads) are what each stage holds.
    plan = make_plan(read_layout(tiny.path), [NodeSpec("a", GiB), NodeSpec("b", GiB)],
                     os_reserve_bytes=0, split=[1, LAYERS - 1])
    assert [s.weight_bytes for s in plan.stages] == [first.nbytes(), second.nbytes()]
    batcher = Batcher(TwoStages(first, second), NodeMetrics(), prefill_chunk=7)
    assert run_streams(batcher, tiny) == tiny.refs


def restore_round(tiny: Tiny, block_size: int, chunk: int, caplog) -> None:
    """A cold prompt, then it and a branch of it after a restore (two rows), then the branch
    alone (one row): all token-identical to mlx-lm; the restores hold every whole block and
    the tail after them."""
    stage = StageRunner(tiny.path)
    # The layout a worker gives its cache (from a forward pass) is what its stores cut.
    layout = None if tiny.family in PREFIX_OFF else block_layout(stage, block_size)
    with PrefixCache(f"tiny/{tiny.family}", (0, LAYERS), block_size=block_size,
                     layout=layout) as cache:
        with caplog.at_level(logging.INFO, logger="omlx_node.stage_state"):
            # Small chunks: a window layer's blocks are cut chunk by chunk as it slides.
            batcher = Batcher(stage, NodeMetrics(), prefill_chunk=chunk, prefix_cache=cache)
        if tiny.family in PREFIX_OFF:
            assert batcher.state.prefix_cache is None
            assert f"prefix cache off: {tiny.family} has ArraysCache layers" in caplog.text
        cold = batcher.submit(SeqRequest("cold", tiny.prompts[4], MAX_TOKENS[4]))
        assert drain(batcher, [cold]) == [tiny.refs[4]]
        again = batcher.submit(SeqRequest("again", tiny.prompts[4], MAX_TOKENS[4]))
        branch = batcher.submit(SeqRequest("branch", tiny.branch, 8))
        assert drain(batcher, [again, branch]) == [tiny.refs[4], tiny.branch_ref]
        alone = batcher.submit(SeqRequest("alone", tiny.branch, 8))
        assert drain(batcher, [alone]) == [tiny.branch_ref]
        if tiny.family not in PREFIX_OFF:
            # Every whole block and the prompt's tail: the branch goes on from all of it.
            held = len(tiny.prompts[4]) - 1
            assert tiny.branch[:held] == tiny.prompts[4][:-1]
            assert again.cached == branch.cached == held
            assert alone.cached == len(tiny.branch) - 1
        assert "KV layout changed" not in caplog.text


def test_prefix_cache_restore_matches_cold(tiny, caplog):
    restore_round(tiny, block_size=4, chunk=6, caplog=caplog)


@pytest.mark.parametrize("tiny", sorted(SLIDING), indirect=True)
def test_prefix_cache_with_blocks_longer_than_the_window(tiny, caplog):
    """16-token blocks over 8-token windows: a chunk must reach a block's end for a window layer
    to hold the block whole (the default chunk, 512 tokens, is twice the default block)."""
    restore_round(tiny, block_size=16, chunk=20, caplog=caplog)


@pytest.mark.parametrize("tiny", ["gpt_oss", "gemma3_text"], indirect=True)
def test_restored_window_layers_trim_as_a_pipeline_stage_does(tiny):
    """A pipeline keeps only the prefix every stage holds (TRIM): restored sliding-window layers
    trim like full ones, and the logits after the rest of the prefill are a cold prefill's."""
    stage = StageRunner(tiny.path)
    prompt = tiny.prompts[4]
    cold = stage.make_cache()
    stage(mx.array([prompt[:-1]]), cold)
    want = stage(mx.array([prompt[-1:]]), cold)
    with PrefixCache(f"tiny/{tiny.family}", (0, LAYERS), block_size=4) as cache:
        state = StageState(stage, NodeMetrics().profile, cache)
        assert state.lookup(1, prompt[:-1]) == 0
        state.prefill(1, mx.array([prompt[:-1]]))  # stores its blocks
        state.free([1])
        held = state.lookup(2, prompt[:-1])
        state.trim(2, held - 12)  # past the 8-token window
        kv = state.prefilling[2]
        assert [c.offset for c in kv] == [held - 12] * LAYERS
        stage(mx.array([prompt[held - 12:-1]]), kv)
        assert mx.array_equal(stage(mx.array([prompt[-1:]]), kv), want)


# ---- live two-stage pipelines (worker processes over mx.distributed) --------------------------


@pytest.mark.parametrize("family, micro_batches", [
    ("gpt_oss", 2),  # MoE + sliding windows, with the prefix cache in 4-token blocks
    ("qwen3_next", 0),  # hybrid linear attention; micro-batches as the head's timing says
])
@pytest.mark.slow
def test_live_two_stage_pipeline_8_streams(family, micro_batches, tmp_path):
    from tests.helpers.pipeline import generate, pipeline, run_concurrently

    path = build_model(tmp_path / family, family, num_layers=LAYERS)
    model, tok = load(str(path))
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = [reference(model, p, 12) for p in prompts]
    with pipeline(path, [1, 3], micro_batches, extra=("--cache-block-size", "4")) as (stub, _):
        outs = run_concurrently(lambda p: generate(stub, p, 12), prompts)
        assert [tokens for tokens, _ in outs] == refs
        # Again: every stage restores the blocks the first round left (LOOKUP, TRIM).
        outs = run_concurrently(lambda p: generate(stub, p, 12), prompts)
        assert [tokens for tokens, _ in outs] == refs
        port = stub.Health(pb.HealthRequest(), timeout=10).metrics_port
        hits = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
        restored = hits.get('omlx_node_kv_cache_hits_total{tier="ram"}', 0)
        assert (restored > 0) == (family not in PREFIX_OFF)


# ---- refusals ---------------------------------------------------------------------------------


def test_refused_family_is_named_at_plan_time_and_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3n", "num_hidden_layers": 1, "hidden_size": 8,
        "num_attention_heads": 2}))
    save_file({"model.embed_tokens.weight": np.zeros((4, 8), np.float16),
               "model.layers.0.mlp.weight": np.zeros((8, 8), np.float16)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model family 'gemma3n' cannot be served: its layers"):
        read_layout(tmp_path)
    with pytest.raises(StageError, match="'gemma3n' cannot be served"):
        StageRunner(tmp_path)


def test_a_family_that_departs_is_named_with_what_differs():
    """A family without the common shape fails at load saying what differs (here RWKV-7, whose
    layers hand each other a value outside their caches); the stage runner checks this for
    families mlx-lm adds later, before any weight is read."""
    from mlx_lm.models import rwkv7

    model = rwkv7.Model(rwkv7.ModelArgs(
        model_type="rwkv7", vocab_size=64, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
        head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8,
        gate_low_rank_dim=8, decay_low_rank_dim=8))
    anatomy = find_anatomy(model)
    with pytest.raises(FamilyError, match=r"rwkv7: layer 0 is called as \(x, v_first, cache\)"):
        check_shape(anatomy, model.make_cache())
