"""Several waiting prompts prefilled in one forward pass, token-identical to mlx-lm alone."""

from __future__ import annotations

import pytest
from mlx_lm import load

from omlx_node import wire
from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from tests.helpers.engine import drain, reference
from tests.tiny_models import build_model


def prefill_passes(metrics: NodeMetrics) -> int:
    return int(metrics.registry.get_sample_value("omlx_node_stage_steps_total",
                                                 {"kind": "prefill"}) or 0)


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    """Distinct prompts of the given lengths (each row of a group must differ to be tested)."""
    return [[(7 * i + 13 * j + 5) % (vocab - 10) + 10 for j in range(n)]
            for i, n in enumerate(lengths)]


# Families whose layers all keep plain KVCaches (MLA and MoE too) share passes; a family with
# sliding windows keeps the one-by-one path.
@pytest.mark.parametrize("family,batchable", [
    ("llama", True), ("qwen3_moe", True), ("deepseek_v3", True), ("phi3", True),
    ("gemma3_text", False),
])
def test_many_prompts_at_once_match_mlx_lm_alone(tmp_path, family, batchable):
    path = build_model(tmp_path / "m", family, num_layers=3)
    model, _ = load(str(path))
    # Two groups of equal lengths, lone lengths, and a one-token prompt (nothing to prefill).
    lengths = [9, 9, 9, 9, 14, 14, 14, 5, 21, 1, 9]
    prompts = prompts_of(lengths, model.args.vocab_size)
    refs = [reference(model, p, 12) for p in prompts]
    metrics = NodeMetrics()
    batcher = Batcher(StageRunner(path), metrics, prefill_chunk=512)
    assert batcher.state.batchable == batchable
    seqs = [batcher.submit(SeqRequest(str(i), p, 12)) for i, p in enumerate(prompts)]
    for (toks, fin), ref in zip(drain(batcher, seqs), refs):
        assert toks == ref
        assert fin.reason == "length"
    # One pass per distinct length with something to prefill (9, 14, 5, 21), not one per prompt.
    assert prefill_passes(metrics) == (4 if batchable else 10)


def test_grouped_prefill_after_a_restored_prefix(tmp_path):
    """Sequences that restore the same cached prefix and have equally many tokens left share
    a pass from their restored caches, and the blocks they complete are stored row by row."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    head = prompts_of([8], model.args.vocab_size)[0]
    branches = [head + p for p in prompts_of([7, 7, 7], model.args.vocab_size)]
    refs = [reference(model, p, 10) for p in [head + [3], *branches]]
    with PrefixCache("tiny/llama", (0, 3), block_size=4) as cache:
        metrics = NodeMetrics()
        batcher = Batcher(StageRunner(path), metrics, prefill_chunk=512, prefix_cache=cache)
        first = batcher.submit(SeqRequest("first", head + [3], 10))
        assert drain(batcher, [first])[0][0] == refs[0]
        passes = prefill_passes(metrics)
        seqs = [batcher.submit(SeqRequest(str(i), p, 10)) for i, p in enumerate(branches)]
        results = drain(batcher, seqs)
        assert [s.cached for s in seqs] == [8, 8, 8]
        for (toks, _), ref in zip(results, refs[1:]):
            assert toks == ref
        assert prefill_passes(metrics) == passes + 1
        # Each branch stored its own third block and tail: a fourth copy restores all but the
        # token it must run.
        again = batcher.submit(SeqRequest("again", branches[1], 10))
        assert drain(batcher, [again])[0][0] == refs[2]
        assert again.cached == len(branches[1]) - 1



def costly_passes(batcher: Batcher) -> None:
    """The engine's pace has measured a pass's fixed part at about a second and a token at a
    millisecond (a GPU's shape, exaggerated): padding to share a pass always pays."""
    batcher.pace.fit = (0.0,) * 5  # what it measured so far, forgotten
    batcher.pace.observe(1.01, False, 10)
    batcher.pace.observe(1.02, False, 20)
    assert batcher.pace.pass_s == pytest.approx(1.0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_prompts_of_other_lengths_and_offsets_share_a_pass_padded(tmp_path, family):
    """Where a pass has a fixed cost, prompts of different lengths that restored prefixes of
    different lengths (and none) prefill in one padded pass, and every stream decodes exactly
    what mlx-lm does alone, many at different offsets."""
    path = build_model(tmp_path / "m", family, num_layers=3)
    model, _ = load(str(path))
    vocab = model.args.vocab_size
    head = prompts_of([8], vocab)[0]
    tails = prompts_of([3, 11, 6, 17, 2], vocab)
    prompts = [head + tails[0], head[:4] + tails[1], head + tails[2], tails[3], tails[4], [42]]
    refs = [reference(model, p, 12) for p in [head + [3], *prompts]]
    with PrefixCache(f"tiny/{family}", (0, 3), block_size=4) as cache:
        metrics = NodeMetrics()
        batcher = Batcher(StageRunner(path), metrics, prefill_chunk=512, prefix_cache=cache)
        first = batcher.submit(SeqRequest("first", head + [3], 12))
        assert drain(batcher, [first])[0][0] == refs[0]
        passes = prefill_passes(metrics)
        costly_passes(batcher)
        seqs = [batcher.submit(SeqRequest(str(i), p, 12)) for i, p in enumerate(prompts)]
        results = drain(batcher, seqs)
        assert [s.cached for s in seqs] == [8, 4, 8, 0, 0, 0]
        for (toks, fin), ref in zip(results, refs[1:]):
            assert toks == ref
            assert fin.reason == "length"
        assert prefill_passes(metrics) == passes + 1
        # Each kept its own blocks, padding cut off: a copy restores all but its last token.
        again = batcher.submit(SeqRequest("again", prompts[3], 12))
        assert drain(batcher, [again])[0][0] == refs[4]
        assert again.cached == len(prompts[3]) - 1


def test_a_padded_prefill_step_carries_each_rows_length():
    """A tensor-parallel stage's other ranks run the same padded pass: the step tells them
    every row's sequence and length."""
    step = wire.Step(wire.PREFILL, target=4, rows=3, tokens=9, seqs=[4, 7, 2],
                     lengths=[9, 3, 5])
    header, payload = wire.encode_header(step, plan=77)
    got, rest = wire.decode_header(header, 77, "rank 0")
    if rest:
        got.load(payload)
    assert (got.seqs, got.lengths, got.rows, got.tokens) == ([4, 7, 2], [9, 3, 5], 3, 9)
    one = wire.Step(wire.PREFILL, target=4, rows=1, tokens=9)
    got, _ = wire.decode_header(wire.encode_header(one, 77)[0], 77, "rank 0")
    assert (got.seqs, got.lengths) == ([], [])


def test_a_prompt_done_before_the_one_ahead_of_it_is_not_lost(tmp_path):
    """The first waiting prompt's chunk is cut to a block boundary (a sliding-window family
    with the prefix cache), which leaves room for a one-token prompt behind it, done at once:
    each must start decoding as itself, none be lost or run twice."""
    path = build_model(tmp_path / "m", "gpt_oss", num_layers=2)
    model, _ = load(str(path))
    long, short = prompts_of([12, 1], model.args.vocab_size)
    refs = [reference(model, p, 8) for p in (long, short)]
    with PrefixCache("tiny/gpt_oss", (0, 2), block_size=4) as cache:
        # 10 tokens of budget: the long prompt's first chunk ends at 8 (a block boundary).
        batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=10,
                          prefix_cache=cache)
        seqs = [batcher.submit(SeqRequest(str(i), p, 8)) for i, p in enumerate((long, short))]
        assert [toks for toks, _ in drain(batcher, seqs)] == refs
