"""Batched sampling (omlx_node.sampling) against mlx-lm's per-row samplers: the same tokens kept,
the same distribution drawn from, greedy rows untouched, seeded rows independent of their batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from omlx_node.sampling import (
    RowSampler,
    SamplingParams,
    filter_candidates,
    keep_candidates,
    sample_batch,
    sample_rows,
)

VOCAB = 1000
# Every filter alone and together; top_k wide enough that the candidate groups are exercised.
FILTERS = [
    {"top_k": 5}, {"top_k": 50}, {"top_k": 999}, {"top_p": 0.9}, {"top_p": 0.3},
    {"min_p": 0.05}, {"min_p": 1.0}, {"top_k": 40, "top_p": 0.5}, {"top_k": 60, "min_p": 0.2},
    {"top_k": 200, "top_p": 0.95, "min_p": 0.01}, {"top_p": 0.8, "min_p": 0.1}, {},
    {"top_p": 1.0, "top_k": -3, "min_p": -0.5},  # each off, as mlx-lm's chain leaves it
]


def mlx_lm_kept(row: mx.array, p: SamplingParams) -> set[int]:
    """The tokens mlx-lm's filters keep of one row, applied as the node chains them."""
    lp = (row - mx.logsumexp(row, keepdims=True))[None]
    if p.top_k > 0:
        lp = apply_top_k(lp, p.top_k)
    if 0.0 < p.top_p < 1.0:
        lp = apply_top_p(lp, p.top_p)
    if p.min_p > 0.0:
        lp = apply_min_p(lp, p.min_p)
    return set(np.flatnonzero(np.isfinite(np.array(lp[0]))).tolist())


def batched_kept(logits: mx.array, params: list[SamplingParams]) -> list[set[int]]:
    ids, x, limits = filter_candidates(logits, params)
    keep = np.broadcast_to(np.array(keep_candidates(x, *limits)), x.shape)
    ids = (np.broadcast_to(np.arange(logits.shape[-1]), keep.shape) if ids is None
           else np.array(ids))
    return [set(ids[i][keep[i]].tolist()) for i in range(len(params))]


def logits_for(n: int, vocab: int = VOCAB, seed: int = 0) -> mx.array:
    # Spread like a real model's: a few likely tokens, a long tail (distinct values: no ties).
    return mx.random.normal((n, vocab), key=mx.random.key(seed)) * 3.0


@pytest.mark.parametrize("mix", ["each alone", "all together", "all with top_k"])
def test_batched_filters_keep_what_mlx_lm_keeps(mix):
    params = [SamplingParams(temperature=0.8, **f) for f in FILTERS]
    if mix == "all with top_k":  # every row ranked among candidates, not the whole vocabulary
        params = [SamplingParams(temperature=0.8, **{**f, "top_k": f.get("top_k", 0) % 999 or 300})
                  for f in FILTERS]
    logits = logits_for(len(params))
    expected = [mlx_lm_kept(logits[i], p) for i, p in enumerate(params)]
    if mix == "each alone":
        got = [batched_kept(logits[i:i + 1], [p])[0] for i, p in enumerate(params)]
    else:
        got = batched_kept(logits, params)
    for p, want, have in zip(params, expected, got):
        assert have == want, p


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 6, "top_p": 0.9, "min_p": 0.1},
                                     {"top_k": 3}])
def test_draws_follow_mlx_lm_distribution(filters):
    """Unseeded rows, one shared draw: each row's token frequencies are softmax(kept / T)."""
    vocab, n, temperature = 16, 40_000, 0.7
    p = SamplingParams(temperature=temperature, **filters)
    row = mx.linspace(-2.0, 2.0, vocab)[mx.random.permutation(vocab, key=mx.random.key(1))]
    lp = (row - mx.logsumexp(row))[None]
    if p.top_k:
        lp = apply_top_k(lp, p.top_k)
    if p.top_p < 1.0:
        lp = apply_top_p(lp, p.top_p)
    if p.min_p:
        lp = apply_min_p(lp, p.min_p)
    want = np.array(mx.softmax(lp[0] / temperature))
    mx.random.seed(5)
    tokens = sample_batch(mx.broadcast_to(row, (n, vocab)), [RowSampler(p) for _ in range(n)])[0]
    freq = np.bincount(np.array(tokens), minlength=vocab) / n
    assert np.abs(freq - want).max() < 0.012, (freq, want)
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_top_p_alone_keeps_what_its_definition_keeps(dtype):
    """With no row asking for top-k, top-p ranks the whole vocabulary, in the model's own
    dtype: it keeps exactly the tokens whose mass before them is under top_p, a tie at the
    threshold kept whole (a half-precision model's logits tie often), a masked (-inf) token
    never, and a row without top-p keeps everything."""
    shares = [0.02, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0]
    logits = logits_for(len(shares)).astype(dtype)
    logits[:, ::7] = -mx.inf  # what a grammar leaves of a row
    params = [SamplingParams(temperature=1.0, top_p=p, min_p=0.0) for p in shares]
    got = batched_kept(logits, params)
    rows = np.array(logits.astype(mx.float32)).astype(np.float64)
    tied = 0  # rows with more than one token at their threshold
    for row, p, have in zip(rows, shares, got):
        if p == 1.0:
            assert have == set(range(VOCAB))
            continue
        x = np.sort(row)[::-1]
        e = np.exp(x - x[0])
        kept = int((np.cumsum(e) - e < p * e.sum()).sum())
        assert have == set(np.flatnonzero(row >= x[kept - 1]).tolist()), p
        tied += int((row == x[kept - 1]).sum() > 1)
    assert tied or dtype != mx.bfloat16  # bfloat16: 8 bits of precision, ties are common


def sample_steps(rows: list[tuple[SamplingParams, int]], steps: int = 6) -> list[list[int]]:
    """Each row's tokens over `steps` steps of one batch; row `r` sees logits seeded by its
    `int`, so a row's logits are the same whatever batch it is in."""
    samplers = [RowSampler(p) for p, _ in rows]
    out = []
    for step in range(steps):
        logits = mx.concatenate([logits_for(1, seed=100 * step + r) for _, r in rows])
        out.append(sample_batch(logits, samplers)[0].tolist())
    return [list(col) for col in zip(*out)]


SEEDED = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234),
          SamplingParams(temperature=0.9, top_p=0.95, seed=7),
          SamplingParams(temperature=1.2, seed=3),
          SamplingParams(temperature=1.0, top_k=50, min_p=0.01, seed=2**63)]
CROWDS = [
    [],
    [(SamplingParams(), 1), (SamplingParams(temperature=0.7, top_k=300), 2)],
    [(SamplingParams(temperature=1.0), 3), (SamplingParams(temperature=0.8, top_p=0.5, seed=9), 4)],
    [(SamplingParams(temperature=0.5, top_k=2, seed=1), 5), (SamplingParams(temperature=2.0), 6),
     (SamplingParams(top_k=1, temperature=1.0), 7)],
]


@pytest.mark.parametrize("seeded", SEEDED, ids=lambda p: f"seed{p.seed}")
def test_a_seeded_row_draws_the_same_whatever_its_batch(seeded):
    alone = sample_steps([(seeded, 0)])[0]
    for crowd in CROWDS:
        before, after = crowd[:1], crowd[1:]  # the row somewhere in the middle of its batch
        assert sample_steps([*before, (seeded, 0), *after])[len(before)] == alone, crowd
    assert sample_steps([(seeded, 0)])[0] == alone  # and again, from a fresh sampler
    other = SamplingParams(**{**seeded.__dict__, "seed": seeded.seed + 1})
    assert sample_steps([(other, 0)])[0] != alone


@pytest.mark.parametrize("seeded", SEEDED, ids=lambda p: f"seed{p.seed}")
def test_a_seeded_row_draws_what_its_own_key_says(seeded):
    """The documented draw, row by row: mlx-lm's filters, then the Gumbel-max over the kept
    tokens with noise from the row's key split once per token: over its top-k, most likely
    first, when it has one, else over the vocabulary in token order."""
    key, want = mx.random.key(seeded.seed), []
    for step in range(6):
        row = logits_for(1, seed=100 * step)[0]
        mask = np.zeros(VOCAB, dtype=bool)
        mask[list(mlx_lm_kept(row, seeded))] = True
        lp = mx.where(mx.array(mask), row, -mx.inf)  # a shift of the log-softmax: same draw
        key, sub = mx.random.split(key)
        if seeded.top_k > 0:
            order = mx.argsort(-row)[:seeded.top_k]
            pick = mx.argmax(lp[order] / seeded.temperature
                             + mx.random.gumbel((seeded.top_k,), key=sub))
            want.append(order[pick].item())
        else:
            want.append(mx.argmax(lp / seeded.temperature
                                  + mx.random.gumbel(row.shape, key=sub)).item())
    assert sample_steps([(seeded, 0)])[0] == want


def test_greedy_rows_take_the_argmax_among_sampled_rows():
    logits = logits_for(6)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=10),
              SamplingParams(top_k=1, temperature=0.9), SamplingParams(temperature=0.5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams()]
    tokens = sample_batch(logits, [RowSampler(p) for p in params])[0].tolist()
    argmax = mx.argmax(logits, axis=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            assert tokens[i] == argmax[i]


def test_a_row_mlx_lm_would_refuse_fails_alone():
    logits = logits_for(4)
    params = [SamplingParams(temperature=1.0, top_k=VOCAB), SamplingParams(),
              SamplingParams(temperature=0.8, top_k=20, seed=42),
              SamplingParams(temperature=0.7, min_p=1.5)]
    tokens, _, failed = sample_rows(logits, [RowSampler(p) for p in params])
    assert sorted(failed) == [0, 3]
    assert failed[0].startswith("ValueError: `top_k`")
    assert failed[3].startswith("ValueError: `min_p`")
    good = [1, 2]
    alone = sample_batch(logits[mx.array(good)], [RowSampler(params[i]) for i in good])[0]
    assert tokens[mx.array(good)].tolist() == alone.tolist()
    mx.random.categorical(mx.zeros((1, 4)))  # the global key is whole


def test_top_k_past_every_group_and_an_odd_vocabulary():
    """A vocabulary no group size divides, and a top-k wider than the groups' count."""
    for vocab, k in [(50_257, 50), (1001, 40), (96, 60)]:
        logits = logits_for(3, vocab)
        params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.99)] * 3
        kept = batched_kept(logits, params)
        assert kept == [mlx_lm_kept(logits[i], params[i]) for i in range(3)]
        assert all(len(s) <= k and max(s) < vocab for s in kept)
        tokens = sample_batch(logits, [RowSampler(p) for p in params])[0].tolist()
        assert all(t in s for t, s in zip(tokens, kept))


def test_every_top_k_ranks_one_of_few_candidate_widths():
    """A compiled sampler keeps a trace for every candidate width it meets, as long as the
    worker runs: the top-k values clients may send map to at most log2(vocab) + 1 widths, each
    wide enough for the row's own top-k (which alone it keeps, as mlx-lm does)."""
    logits = logits_for(2)
    widths = set()
    for k in range(1, VOCAB):
        params = [SamplingParams(temperature=1.0, top_k=k)] * 2
        _, x, _ = filter_candidates(logits, params)
        assert x.shape[-1] >= k
        widths.add(x.shape[-1])
    assert len(widths) <= VOCAB.bit_length() + 1, sorted(widths)
    for k in (3, 37, 700):
        params = [SamplingParams(temperature=1.0, top_k=k)] * 2
        assert batched_kept(logits, params) == [mlx_lm_kept(logits[i], params[i])
                                                for i in range(2)]
