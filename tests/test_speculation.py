"""Speculative decoding in one engine (omlx_node.speculation): drafts from prompt lookup and from
a prediction, verified inside continuous batching, give the tokens (and logprobs) decoding one
at a time gives, and sampled rows keep the target's distribution."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from prometheus_client import generate_latest

from omlx_coordinator.telemetry.rebalancer import parse_stage
from omlx_node import speculation
from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import PROFILE_EVERY, NodeMetrics
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import SeqRequest
from omlx_node.speculation import (
    NgramProposer,
    PredictionProposer,
    SpecStats,
    Speculator,
    best_k,
    crossover,
    expected_tokens,
    target_probs,
    verify_cost,
    verify_sampled,
)
from omlx_node.stage import StageRunner
from omlx_shared.prometheus import labelled
from omlx_shared.speculative_modes import check_mode
from tests.helpers.engine import assert_logprobs_match, drain, reference
from tests.helpers.speculation import FLAT, TEXT, mixed_requests, run_one


@pytest.fixture(autouse=True)
def flat_costs(request, monkeypatch):
    """Every engine gets FLAT but in the tests of the cost policy (named so)."""
    if "cost" not in request.node.name:
        monkeypatch.setattr(speculation, "position_costs", lambda stage: FLAT)


@pytest.fixture(scope="module")
def mlx_lm_model(llama_2_layers):
    return load(str(llama_2_layers))


def engine(llama_2_layers: Path, mode: str = "ngram", max_rows: int | None = None,
           **kwargs) -> Batcher:
    batcher = Batcher(StageRunner(llama_2_layers), NodeMetrics(), speculative=mode, **kwargs)
    if max_rows is not None:
        batcher.speculator.max_rows = max_rows
    return batcher


def test_proposers_read_on_where_they_matched():
    ngram = NgramProposer()
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert ngram.propose(tokens, [], 3) == [4, 5, 9]  # the 3-gram [1, 2, 3], what followed it
    assert ngram.propose([7, 8, 7], [], 4) == [8, 7]  # only a 1-gram recurs
    assert ngram.propose([1, 2, 3], [], 4) == []
    pred = PredictionProposer([10, 11, 12, 10, 11, 13, 14])
    assert pred.propose([5], [], 3) == [10, 11, 12]  # nothing out yet: its beginning
    assert pred.propose([5, 10, 11, 12, 10, 11], [10, 11, 12, 10, 11], 3) == [13, 14]
    assert pred.propose([5, 99], [99], 3) == [] and pred.source == "ngram"
    assert pred.propose([5, 99, 4, 99], [99, 4, 99], 3) == [4, 99]  # its own tokens, then
    assert pred.source == "ngram"
    with pytest.raises(ValueError, match="off, ngram, auto"):
        check_mode("draft")


def test_lookup_finds_what_a_plain_scan_finds():
    """Prompt lookup against the definition, scanned by hand: on a small alphabet (many
    repeats), every suffix length, cursor and k; and a proposer fed a growing row (its tokens
    converted only as they come) drafts what a fresh one drafts from the whole row."""
    rng = np.random.default_rng(3)

    def scan(corpus: list[int], suffix: list[int], k: int, after: int) -> tuple[list[int], int]:
        n, end = len(suffix), len(corpus)
        hits = [i + n for i in range(end - n) if corpus[i:i + n] == suffix]  # a token after
        if not n or not hits:
            return [], 0
        start = next((h for h in hits if h >= after), hits[-1])
        return corpus[start:start + k], start

    for _ in range(300):
        corpus = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        after = int(rng.integers(0, len(corpus) + 2))
        suffix = corpus[-n:]
        assert speculation.lookup(np.array(corpus), len(corpus), np.array(suffix), k,
                                  after) == scan(corpus, suffix, k, after), (corpus, n, after)
    row = rng.integers(0, 6, 30).tolist()
    growing = NgramProposer()
    for _ in range(60):
        fresh = NgramProposer()
        fresh.cursor = growing.cursor
        assert growing.propose(row, [], 4) == fresh.propose(row, [], 4)
        row = row + rng.integers(0, 6, int(rng.integers(1, 4))).tolist()


@pytest.mark.parametrize("source", ["ngram", "prediction"])
def test_greedy_drafts_give_mlx_lms_tokens(llama_2_layers, mlx_lm_model, source):
    model, tok = mlx_lm_model
    prompt, n = tok.encode(TEXT), 40
    ref = reference(model, prompt, n)
    prediction = tuple(ref[:15]) + (7, 7, 7) + tuple(ref[18:])  # some of it wrong
    req = SeqRequest("a", prompt, n, prediction=prediction if source == "prediction" else ())
    plain, reason, _ = run_one(engine(llama_2_layers, "off"), SeqRequest("a", prompt, n))
    batcher = engine(llama_2_layers, "ngram")
    tokens, reason, seq = run_one(batcher, req)
    assert tokens == plain == ref and reason == "length"
    assert seq.spec.accepted > 0 and seq.spec.drafted > seq.spec.accepted
    if source == "prediction":
        assert 0 < seq.spec.predicted_accepted <= seq.spec.accepted
    # Fewer forward passes than tokens: that is the point.
    assert batcher.metrics.profile._steps["decode"]._value.get() < n - seq.spec.accepted / 2


def test_drafting_is_timed_apart_from_the_layers(llama_2_layers, mlx_lm_model):
    """The stage exports its drafting time, which the rebalancer reads from its /metrics and
    takes off its step time (omlx_coordinator.planning.rebalance_policy); without drafts, 0."""
    _, tok = mlx_lm_model
    identity = {"node": "n0", "model": "m", "plan": "p1", "stage": "0", "layers": "0-2"}
    for mode in ("ngram", "off"):
        batcher = engine(llama_2_layers, mode)
        _, _, seq = run_one(batcher, SeqRequest("a", tok.encode(TEXT), 30))
        text = generate_latest(labelled(batcher.metrics.registry, identity)).decode()
        plan, reading = parse_stage(text)
        assert (plan, reading.node) == ("p1", "n0")
        assert (reading.draft_seconds > 0) is (mode == "ngram") and (seq.spec.drafted > 0) is (
            mode == "ngram")


def test_a_timed_step_waits_for_the_input_read_before_it():
    """A pipeline head that drafts reads the tail's tokens on the host before it builds the
    step they feed (omlx_node.pipeline): that read is the timed step's wait for its input, not
    time of its own."""
    profile = NodeMetrics().profile
    profile.peer_inputs = frozenset({"decode"})
    x = mx.zeros((1, 1))
    for _ in range(2 * PROFILE_EVERY):
        profile.receive(lambda: time.sleep(0.1))
        profile.run("decode", x, lambda: x + 1)
    # Two timed steps: both reads are wait; counted as compute they would be 0.2 s of it.
    wait = profile._wait["decode"]
    assert wait._sum.get() >= 2 * 0.1 and profile._compute["decode"]._sum.get() < 0.1


def test_eight_streams_mix_speculating_and_plain_rows(llama_2_layers, mlx_lm_model):
    """Drafting rows (prompt lookup, a prediction), and rows that never draft (penalties)
    share each step; each gets what it gets alone, logprobs included."""
    model, tok = mlx_lm_model
    prompts, refs, reqs = mixed_requests(model, tok, 30)
    batcher = engine(llama_2_layers, "ngram", max_rows=8)
    seqs = [batcher.submit(r) for r in reqs]
    results = drain(batcher, seqs)
    assert sum(s.spec.accepted for s in seqs) > 0 and seqs[5].spec.drafted == 0
    for seq, (tokens, finish), ref in zip(seqs, results, refs):
        if seq.req.request_id == "5":
            continue  # penalised: its own reference below
        assert tokens == [t for t, _ in ref], seq.req.request_id
        assert finish.reason == "length"
        if seq.req.sampling.logprobs:
            got = [(t, lp.logprob, lp.top_ids, lp.top_logprobs)
                   for t, lp in zip(tokens, seq.logprobs)]
            assert_logprobs_match(got, ref, 3)
    plain, _, _ = run_one(engine(llama_2_layers, "off"), reqs[5])
    assert results[5][0] == plain


def test_a_stop_token_or_max_tokens_inside_an_accepted_run(llama_2_layers, mlx_lm_model):
    """A prediction that is all right: long runs stand, and whatever ends the sequence inside
    one (its stop token, max_tokens) ends it there, the rest of the run never streamed."""
    model, tok = mlx_lm_model
    prompt = tok.encode("The capital of France is")
    ref = reference(model, prompt, 24)
    batcher = engine(llama_2_layers)
    for n in range(1, 12):
        tokens, reason, seq = run_one(batcher, SeqRequest(f"n{n}", prompt, n,
                                                          prediction=tuple(ref)))
        assert (tokens, reason) == (ref[:n], "length")
    # Each step streams 4 drafted tokens that stood and then its own: positions 4, 9, 14...
    # are a step's own; the stop token is put where a draft stands.
    at = next(i for i in range(6, 20) if ref[i] not in ref[:i] and i % 5 != 4)
    tokens, reason, seq = run_one(batcher, SeqRequest(
        "stop", prompt, 24, stop_token_ids=frozenset({ref[at]}), prediction=tuple(ref)))
    assert (tokens, reason) == (ref[:at], "stop") and seq.spec.accepted >= at - at // 5


def test_rejected_drafts_never_reach_the_prefix_cache(llama_2_layers, mlx_lm_model):
    """A turn's answer is kept for the next turn (keep_answers): what is kept is exactly the
    tokens that stood, so the next turn, served from those blocks, still decodes mlx-lm's."""
    model, tok = mlx_lm_model
    cache = PrefixCache("m", (0, 2), block_size=4, hot_max_bytes=1 << 30)
    batcher = engine(llama_2_layers, prefix_cache=cache)
    prompt = tok.encode(TEXT)
    ref = reference(model, prompt, 30)
    wrong = tuple(ref[:3]) + tuple((t + 1) % 300 for t in ref[3:])
    tokens, _, seq = run_one(batcher, SeqRequest("a", prompt, 30, prediction=wrong))
    assert tokens == ref and seq.spec.drafted > seq.spec.accepted
    follow = prompt + tokens + tok.encode(" again")
    tokens, _, seq = run_one(batcher, SeqRequest("b", follow, 20))
    assert seq.cached >= len(prompt) and tokens == reference(model, follow, 20)
    cache.close()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = probs * n
    seen = expected > 0
    assert counts[~seen].sum() == 0  # nothing drawn the target never draws
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def wrong_rule(probs: np.ndarray, draft: list[int], u: np.ndarray) -> int:
    """A broken acceptance rule: a rejected token redrawn from p itself, not the residual."""
    p = probs[0].astype(np.float64)
    if u[0] < p[draft[0]]:
        return draft[0]
    return int(min(np.searchsorted(np.cumsum(p), u[1] * p.sum(), side="right"), len(p) - 1))


def test_sampled_rows_keep_the_targets_distribution(llama_2_layers):
    """The first token of a sampled row whose draft is fixed: over many seeded draws, its
    frequencies pass a chi-square test against the target's own distribution (top-k and
    temperature applied); a broken rule (no residual) fails the same test."""
    vocab, n, k = 8, 20_000, 6
    model = StageRunner(llama_2_layers)
    prompt = mx.array([[5, 6, 7, 5, 6]])
    logits = model(prompt, model.make_cache())[0, -2:, :vocab] * 4  # a tiny vocabulary
    params = SamplingParams(temperature=0.9, top_k=k)
    probs = np.array(target_probs(logits, params))
    draft = [int(np.argsort(probs[0])[-2])]  # likely, not the likeliest: both paths taken
    rng = np.random.default_rng(0)
    firsts = np.zeros(vocab, dtype=np.int64)
    broken = np.zeros(vocab, dtype=np.int64)
    seconds = np.zeros(vocab, dtype=np.int64)
    for _ in range(n):
        u = rng.random(4)
        v = verify_sampled(probs, draft, u)
        first = v.accepted[0] if v.accepted else v.token
        firsts[first] += 1
        if v.accepted:  # the position after an accepted draft draws from p there
            seconds[v.token] += 1
        broken[wrong_rule(probs, draft, u)] += 1
    bound = 24.3  # chi-square's 0.999 quantile at 7 degrees of freedom
    assert chi_square(firsts, probs[0]) < bound
    assert chi_square(seconds, probs[1]) < bound
    assert chi_square(broken, probs[0]) > 10 * bound
    assert (probs[0] > 0).sum() == k


def test_sampled_rows_draft_and_seeded_rows_do_not(llama_2_layers, mlx_lm_model):
    """An unseeded sampled row drafts (accepted > 0 at a low temperature, its prediction the
    greedy tokens); a seeded one does not: its tokens are its seed's whether or not its batch
    is small enough to speculate."""
    model, tok = mlx_lm_model
    prompt = tok.encode(TEXT)
    cold = SamplingParams(temperature=0.02)
    _, _, seq = run_one(engine(llama_2_layers), SeqRequest(
        "a", prompt, 30, cold, prediction=tuple(reference(model, prompt, 30))))
    assert seq.spec.accepted > 0
    seeded = SamplingParams(temperature=0.3, seed=7)
    on, _, seq = run_one(engine(llama_2_layers), SeqRequest("b", prompt, 30, seeded))
    off, _, _ = run_one(engine(llama_2_layers, "off"), SeqRequest("b", prompt, 30, seeded))
    assert on == off and seq.spec.drafted == 0


def test_auto_drafts_only_where_a_wider_step_costs_little(llama_2_layers, monkeypatch):
    """"auto" measures what k+1 positions cost against one (one layer's MLP): weight-bound
    (about the same) it drafts, compute-bound (k+1 times as much) it does not."""
    stage = StageRunner(llama_2_layers)
    assert verify_cost(stage) > 0.5
    measured = Speculator("ngram", stage)
    assert measured.max_rows >= 1 and set(measured.costs) >= {1, 2, 3, 4, 5}
    for costs, on in (({1: 1.0, 5: 1.2}, True), ({1: 1.0, 5: 4.8}, False)):
        monkeypatch.setattr(speculation, "row_costs", lambda *a, costs=costs, **kw: costs)
        stage = StageRunner(llama_2_layers)  # a stage's curve is measured once
        assert Speculator("auto", stage).on is on
        assert Speculator("ngram", stage).on  # asked for: one row at a time at least


def test_the_crossover_and_k_follow_the_cost_curve():
    """Speculation steps aside past the rows where B(k+1) positions cost more than twice B
    (a curve flat to 16 positions, then proportional: 3 rows of 5 positions are 15); k
    follows a row's acceptance and what positions cost."""
    knee = {1: 1.0, 16: 1.0, 32: 2.0, 64: 4.0}
    assert crossover(knee, 4, 64) == 6  # 30 positions cost 1.9, 35 cost 2.2 against 1
    assert crossover(FLAT, 4, 64) == 64
    assert crossover({1: 1.0, 5: 4.8}, 4, 64) == 0
    steep = {1: 1.0, 2: 2.0, 64: 64.0}
    assert best_k(0.95, FLAT, 4, 0.0) == 4 and best_k(0.95, steep, 4, 0.0) == 1
    assert best_k(0.3, {1: 1.0, 2: 1.1, 3: 1.3, 4: 1.6, 5: 2.0}, 4, 0.0) == 1
    assert best_k(0.8, {1: 1.0, 2: 1.1, 3: 1.3, 4: 1.6, 5: 2.0}, 4, 0.0) == 2
    # A draft model's passes cost too: a dear one drafts less.
    assert best_k(0.8, FLAT, 4, 0.0) == 4 and best_k(0.8, FLAT, 4, 0.5) == 2
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


def test_a_rows_k_shrinks_as_its_drafts_fail(llama_2_layers):
    """A row whose drafts stand drafts k_max; one whose drafts keep failing at the second
    token drafts fewer (on a curve where positions are not free)."""
    spec = Speculator("ngram", StageRunner(llama_2_layers),
                      costs={1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4})
    good, bad, proposer = SpecStats(), SpecStats(), NgramProposer()
    for _ in range(6):
        spec.counted(proposer, good, 4, 4)
        spec.counted(proposer, bad, 4, 1)
    assert good.alpha > 0.9 and bad.alpha < 0.6
    k = {id(s): best_k(s.alpha, spec.costs, spec.k, 0.0) for s in (good, bad)}
    assert k[id(good)] == 4 and k[id(bad)] == 2


def test_off_drafts_nothing_not_even_a_prediction(llama_2_layers, mlx_lm_model):
    model, tok = mlx_lm_model
    prompt = tok.encode(TEXT)
    ref = reference(model, prompt, 20)
    tokens, _, seq = run_one(engine(llama_2_layers, "off"),
                             SeqRequest("a", prompt, 20, prediction=tuple(ref)))
    assert tokens == ref and seq.spec.drafted == 0


def test_a_row_whose_drafts_fail_backs_off(llama_2_layers):
    """Drafts none of which stood make the row wait 2, 4, ... (up to 16) steps before it
    drafts again; one that stands ends the wait."""
    spec, stats = Speculator("ngram", StageRunner(llama_2_layers)), SpecStats()
    proposer = NgramProposer()
    waits = []
    for _ in range(5):
        spec.counted(proposer, stats, 4, 0)
        steps = 1
        while not spec.wanted([stats], 1):
            steps += 1
        waits.append(steps)
    assert waits == [3, 5, 9, 17, 17]  # (the step that drafts again counted too)
    spec.counted(proposer, stats, 4, 0)
    spec.counted(proposer, stats, 4, 1)
    assert stats.wait == 0 and spec.wanted([stats], 1)
    assert not spec.wanted([SpecStats()], spec.max_rows + 1)  # a batch too large


def test_constrained_rows_decode_beside_drafting_rows(llama_2_layers, mlx_lm_model):
    """A row under a grammar never drafts (its matcher would have to follow each drafted
    token): it decodes one token a step in the drafting rows' passes, and its output is what
    it is in a batcher that never drafts, following the schema."""
    from omlx_node.constraints import Grammars
    from tests.helpers.constraints import GRAMMAR, parse

    model, tok = mlx_lm_model
    prompt = tok.encode(TEXT)
    ref = reference(model, prompt, 30)
    outputs = []
    for mode in ("off", "ngram"):
        batcher = engine(llama_2_layers, mode, grammars=Grammars(llama_2_layers))
        seqs = [batcher.submit(SeqRequest("g", prompt, 64, grammar=GRAMMAR)),
                batcher.submit(SeqRequest("p", prompt, 30, prediction=tuple(ref)))]
        outputs.append(drain(batcher, seqs))
    (off_g, off_p), (on_g, on_p) = outputs
    assert on_g == off_g and on_g[1].reason == "stop"
    parse(tok, on_g[0])
    assert on_p[0] == off_p[0] == ref
    assert seqs[1].spec.accepted > 0 and seqs[0].spec.drafted == 0
