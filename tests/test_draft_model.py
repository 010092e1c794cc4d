"""A draft model (`--speculative draft=PATH`, omlx_node.draft_model) drafting inside continuous
batching: greedy tokens equal mlx-lm's and the engine's without drafts, alone and in 8 mixed
concurrent rows, ended by a stop token or max_tokens inside an accepted run; its KV cache keeps
only the row's tokens; a draft of another tokenizer, or "mtp", is refused saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from omlx_node import speculation
from omlx_node.batcher import Batcher
from omlx_node.draft_model import DraftError, DraftModel
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from omlx_shared.speculative_modes import check_mode
from tests.helpers.engine import assert_logprobs_match, drain, reference
from tests.helpers.speculation import FLAT, TEXT, mixed_requests, run_one
from tests.tiny_models import CORPUS, build_model, truncated_model


def damped(src: Path, dest: Path, scale: float = 0.6) -> Path:
    """A copy of `src` whose last layer adds `scale` of what it adds in `src`."""
    shutil.copytree(src, dest)
    weights = mx.load(str(dest / "model.safetensors"))
    last = json.loads((src / "config.json").read_text())["num_hidden_layers"] - 1
    for name in weights:
        if name.startswith(f"model.layers.{last}.") and ("o_proj" in name or "down_proj" in name):
            weights[name] = weights[name] * scale
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    target = build_model(root / "target", "llama", num_layers=3)
    return {
        "target": target,
        # Its last layer damped: agrees with the target's greedy token most of the time.
        "early": damped(target, root / "early"),
        # Its first two layers (an early exit): a random model's agree seldom.
        "short": truncated_model(target, root / "short", 2),
        # Another model of the same tokenizer: agrees seldom (rejections trimmed every step).
        "other": build_model(root / "other", "llama", num_layers=1, seed=5),
        # Another tokenizer (trained on other text): refused.
        "alien": build_model(root / "alien", "llama", num_layers=1,
                             corpus=[c[::-1] for c in CORPUS]),
    }


@pytest.fixture(autouse=True)
def flat_costs(monkeypatch):
    """A weight-bound device's curve, and a free draft model: rows draft k_max tokens while
    their drafts stand (test_speculation tests the policy on measured curves)."""
    monkeypatch.setattr(speculation, "position_costs", lambda stage: FLAT)
    monkeypatch.setattr(speculation, "best_k", lambda alpha, costs, k_max, share: k_max)


@pytest.fixture(scope="module")
def mlx_lm_model(models):
    return load(str(models["target"]))


def engine(models: dict[str, Path], draft: str, max_rows: int | None = None) -> Batcher:
    mode = f"draft={models[draft]}" if draft in models else draft
    batcher = Batcher(StageRunner(models["target"]), NodeMetrics(), speculative=mode)
    if max_rows is not None:
        batcher.speculator.max_rows = max_rows
    return batcher


@pytest.mark.parametrize("draft", ["target", "early", "short", "other"])
def test_greedy_tokens_are_mlx_lms_with_any_draft(models, mlx_lm_model, draft):
    model, tok = mlx_lm_model
    prompt, n = tok.encode("The capital of France is"), 40
    ref = reference(model, prompt, n)
    plain, _, _ = run_one(engine(models, "off"), SeqRequest("a", prompt, n))
    batcher = engine(models, draft)
    tokens, reason, seq = run_one(batcher, SeqRequest("a", prompt, n))
    assert tokens == plain == ref and reason == "length"
    steps = batcher.metrics.profile._steps["decode"]._value.get()
    if draft == "target":  # its own draft: every draft token stands, k+1 tokens a step
        assert seq.spec.accepted == seq.spec.drafted > 0 and steps < n / 3
    elif draft == "early":
        assert seq.spec.drafted > seq.spec.accepted > 0
    else:
        assert seq.spec.drafted > seq.spec.accepted
    assert seq.proposer.source == "draft"
    # Its cache holds the row's tokens and nothing rejected: the last proposal's tokens
    # (prompt and output so far), then the drafts not yet refuted.
    held = seq.proposer.held
    assert held[:seq.proposer.known] == (prompt + tokens)[:seq.proposer.known]
    assert seq.proposer.cache[0].offset == len(held)


def test_drafts_are_the_draft_models_own_greedy_tokens(models):
    """A proposal is the draft model's greedy continuation, whatever the cache held before
    (rejected drafts trimmed, a catch-up of several tokens fed)."""
    draft_lm, tok = load(str(models["short"]))
    proposer = DraftModel(models["short"], StageRunner(models["target"])).proposer()
    tokens = tok.encode(TEXT)
    proposer.feed(tokens[:9])  # a prompt's first chunks, computed alongside its prefill
    proposer.feed(tokens[:17])
    assert proposer.cache[0].offset == 17
    for cut, k in ((20, 4), (23, 4), (22, 3), (40, 4), (41, 1)):
        assert proposer.propose(tokens[:cut], [], k) == reference(draft_lm, tokens[:cut], k)
        assert proposer.cache[0].offset == len(proposer.held)


def test_eight_streams_mix_drafting_and_plain_rows(models, mlx_lm_model):
    """Draft-model rows, prediction rows and rows that never draft (a penalty) share each
    step; each gets what it gets alone, logprobs included."""
    model, tok = mlx_lm_model
    n = 30
    prompts, refs, reqs = mixed_requests(model, tok, n, longer=True)
    batcher = engine(models, "early", max_rows=8)
    seqs = [batcher.submit(r) for r in reqs]
    results = drain(batcher, seqs)
    assert seqs[5].spec.drafted == 0
    assert sum(s.spec.accepted for s in seqs if s.proposer.source == "draft") > 0
    for i, (seq, (tokens, finish)) in enumerate(zip(seqs, results)):
        assert finish.reason == "length" and len(tokens) == n + i
        if i == 5:
            continue  # penalised: its own reference below
        assert tokens[:n] == [t for t, _ in refs[i]], i
        assert tokens == reference(model, prompts[i], n + i), i
        if seq.req.sampling.logprobs:
            got = [(t, lp.logprob, lp.top_ids, lp.top_logprobs)
                   for t, lp in zip(tokens, seq.logprobs)]
            assert_logprobs_match(got[:n], refs[i], 3)
    plain, _, _ = run_one(engine(models, "off"), reqs[5])
    assert results[5][0] == plain


def test_a_stop_token_or_max_tokens_inside_an_accepted_run(models, mlx_lm_model):
    """The target drafting for itself: every draft stands, and whatever ends the sequence
    inside a run (its stop token, max_tokens) ends it there."""
    model, tok = mlx_lm_model
    prompt = tok.encode("The capital of France is")
    ref = reference(model, prompt, 24)
    batcher = engine(models, "target")
    for n in range(1, 12):
        tokens, reason, _ = run_one(batcher, SeqRequest(f"n{n}", prompt, n))
        assert (tokens, reason) == (ref[:n], "length")
    at = next(i for i in range(6, 20) if ref[i] not in ref[:i] and i % 5 != 4)
    tokens, reason, seq = run_one(batcher, SeqRequest(
        "stop", prompt, 24, stop_token_ids=frozenset({ref[at]})))
    assert (tokens, reason) == (ref[:at], "stop") and seq.spec.accepted >= at - at // 5


def test_sampled_rows_draft_and_seeded_rows_do_not(models, mlx_lm_model):
    model, tok = mlx_lm_model
    prompt = tok.encode(TEXT)
    _, _, seq = run_one(engine(models, "target"),
                        SeqRequest("a", prompt, 30, SamplingParams(temperature=0.02)))
    assert seq.spec.accepted > 0
    seeded = SamplingParams(temperature=0.3, seed=7)
    on, _, seq = run_one(engine(models, "target"), SeqRequest("b", prompt, 30, seeded))
    off, _, _ = run_one(engine(models, "off"), SeqRequest("b", prompt, 30, seeded))
    assert on == off and seq.spec.drafted == 0


def test_a_draft_of_another_tokenizer_or_none_is_refused(models, tmp_path):
    target = StageRunner(models["target"])
    with pytest.raises(DraftError, match="another tokenizer than the model it drafts for"):
        DraftModel(models["alien"], target)
    with pytest.raises(DraftError, match="has no config.json"):
        DraftModel(tmp_path, target)
    with pytest.raises(ValueError, match="names no folder"):
        check_mode("draft=")
    with pytest.raises(ValueError, match="mlx-lm 0.32 loads no model family's multi-token"):
        check_mode("mtp")


def test_the_plan_counts_the_draft_on_the_first_stage(models):
    """The draft model's weights are held beside the first stage's layers: a plan counts them
    there (and a node too small for both refuses the pair)."""
    from omlx_coordinator.planning.model_layout import read_layout, with_draft
    from omlx_coordinator.planning.planner import NodeSpec, PlanError, make_plan

    plain = read_layout(models["target"])
    layout = with_draft(plain, models["early"])
    assert layout.draft_bytes == read_layout(models["early"]).total_weight_bytes > 0
    nodes = [NodeSpec("a", 1 << 30, speed=100.0), NodeSpec("b", 1 << 30, speed=100.0)]
    kw = {"os_reserve_bytes": 0, "context_tokens": 16, "max_sequences": 1, "split": [2, 1]}
    first, second = make_plan(layout, nodes, **kw).stages
    base_first, base_second = make_plan(plain, nodes, **kw).stages
    assert first.weight_bytes - base_first.weight_bytes == layout.draft_bytes
    assert second.weight_bytes == base_second.weight_bytes
    need = make_plan(plain, nodes[:1], os_reserve_bytes=0, context_tokens=16,
                     max_sequences=1).stages[0].memory_bytes
    with pytest.raises(PlanError):
        make_plan(layout, [NodeSpec("a", need + layout.draft_bytes // 2, speed=100.0)],
                  os_reserve_bytes=0, context_tokens=16, max_sequences=1)


def test_a_row_that_drafts_late_catches_its_draft_up(models, mlx_lm_model):
    """Admitted with more rows than may speculate, a row's prompt skips the draft model; once
    the others end it drafts, its draft first computing all it missed, and its tokens stay
    mlx-lm's."""
    model, tok = mlx_lm_model
    prompt = tok.encode("The capital of France is")
    batcher = engine(models, "target", max_rows=1)
    seqs = [batcher.submit(SeqRequest(str(n), prompt, n)) for n in (3, 5, 30)]
    results = drain(batcher, seqs)
    ref = reference(model, prompt, 30)
    assert [tokens for tokens, _ in results] == [ref[:3], ref[:5], ref]
    assert seqs[0].spec.drafted == seqs[1].spec.drafted == 0
    assert seqs[2].spec.accepted == seqs[2].spec.drafted > 0
