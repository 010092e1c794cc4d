"""Per-sequence sampling over a batch of logits.

Every row of a batch may carry its own temperature, top-p, top-k, min-p and seed. Greedy rows take
the argmax of the raw logits, exactly what mlx-lm's default sampler picks. The other rows are drawn
together, in one batched computation with their parameters as per-row arrays, from the tokens
mlx-lm's sampler chain would keep (top-k, then top-p, then min-p), by the Gumbel-max draw of
mx.random.categorical, in one compiled computation: a sampled batch costs about what a greedy one
does. Unseeded rows share one draw from mx.random's global key. A seeded row owns a PRNG key that
is split once per token and draws its own noise, so its output depends only on its seed and its
logits, never on which other sequences shared the batch (up to exact ties between its logits).

A row may also ask for, each costing only the rows that ask:
- penalties: mlx-lm's own logits processors (`make_logits_processors`: repetition, presence,
  frequency, in that order) over the row's last PENALTY_CONTEXT tokens, prompt included, exactly
  the tokens mlx-lm's generate_step hands them;
- a grammar (omlx_node.constraints): tokens it does not allow get -inf before sampling;
- logprobs: the sampled token's log-probability and its `logprobs` most likely alternatives.
  They are the log-softmax of the logits after the penalties and before the grammar mask and the
  temperature/top-p/top-k/min-p filters: what mlx-lm's generate_step yields as `logprobs`. So
  they say how likely the model found a token; a constrained row's mask narrows the choice
  without renormalising the numbers it reports.

A row's failure is its own (`sample_rows`): a sampler, penalty or grammar mask that raises ends
that row alone, and the others sample exactly what they would have. A function compiled with
mx.random's global key as an input and an output (as mlx-lm's samplers are) that raises while
tracing leaves a placeholder key behind that no later unseeded sample can evaluate ("array
without a primitive"): every failure puts the key back (`random_key`, `restore_random_key`).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from omlx_node.constraints import GrammarMatcher, allowed_tokens, fill_masks

# mlx-lm's default context for its penalties (make_logits_processors).
PENALTY_CONTEXT = 20
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 0 or 1 = off
    logprobs: int | None = None  # report logprobs with this many alternatives; None: none

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty not in (0.0, 1.0))


@dataclass(frozen=True)
class Logprob:
    """One sampled token's log-probability and the most likely tokens at its position."""

    logprob: float
    top_ids: list[int]  # most likely first
    top_logprobs: list[float]


class RowSampler:
    """The sampling state of one sequence: its parameters, its PRNG key when seeded, the tokens
    its penalties look at, and its grammar's matcher."""

    def __init__(self, params: SamplingParams, context: Sequence[int] = (),
                 grammar: GrammarMatcher | None = None):
        """`context`: the sequence's tokens so far (its prompt); only penalized rows keep them."""
        self.params = params
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self.grammar = grammar
        p = params
        self.processors = make_logits_processors(
            repetition_penalty=p.repetition_penalty if p.repetition_penalty not in (0, 1) else None,
            repetition_context_size=PENALTY_CONTEXT,
            presence_penalty=p.presence_penalty or None, presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=p.frequency_penalty or None, frequency_context_size=PENALTY_CONTEXT,
        ) if p.penalized else []
        self.history = (mx.array(list(context[-PENALTY_CONTEXT:]), dtype=mx.int32)
                        if self.processors else None)

    @property
    def plain(self) -> bool:
        """Samples from the raw logits and reports nothing but the token."""
        return not self.processors and self.grammar is None and self.params.logprobs is None

    def process(self, logits: mx.array) -> mx.array:
        """logits: (1, V) -> the same after this row's penalties."""
        for processor in self.processors:
            logits = processor(self.history, logits)
        return logits

    def remember(self, token: mx.array) -> None:
        """Appends the sampled token (lazy, shape (1,)) to what the penalties look at."""
        self.history = mx.concatenate([self.history, token.astype(mx.int32)])[-PENALTY_CONTEXT:]

    @classmethod
    def stand_in(cls, params: SamplingParams) -> RowSampler:
        """A greedy sampler that cannot fail, for a row whose own did: it holds the row's place
        (and its logprob record's, so a step's records keep their layout) until the row leaves
        the batch. Its tokens are never streamed."""
        return cls(SamplingParams(logprobs=params.logprobs))

    def snapshot(self) -> tuple[mx.array | None, mx.array | None]:
        """What sampling a token changes: its PRNG key and its penalties' history."""
        return self.key, self.history

    def rewind(self, state: tuple[mx.array | None, mx.array | None]) -> None:
        self.key, self.history = state


def make_sampler(params: SamplingParams, context: Sequence[int] = (),
                 grammar: GrammarMatcher | None = None) -> tuple[RowSampler, str]:
    """A row's sampler and "", or, when its own cannot be made, a stand-in and why."""
    try:
        return RowSampler(params, context, grammar), ""
    except Exception as e:  # the row's parameters; never the batch's concern
        return RowSampler.stand_in(params), f"{type(e).__name__}: {e}"


def random_key() -> mx.array:
    """mx.random's global key now (lazy: holding it costs nothing)."""
    return mx.random.state[0]


def restore_random_key(key: mx.array) -> None:
    """Puts back a key `random_key` returned, over whatever a failed step left there; a fresh
    one if that key was a placeholder already (left by a failure before the step)."""
    try:
        hi, lo = key.tolist()
    except RuntimeError:
        hi, lo = struct.unpack("<II", os.urandom(8))
    mx.random.seed((hi << 32) | lo)  # mx.random.key(seed) is [seed >> 32, seed & 0xFFFFFFFF]


def sample_rows(logits: mx.array, samplers: list[RowSampler]
                ) -> tuple[mx.array, mx.array | None, dict[int, str]]:
    """`sample_batch`, with each row's failure its own: a row whose sampling raises (its
    filters, its penalties, its grammar's mask) gets a stand-in in `samplers` (in place) and its
    error in the returned dict, by row index; every other row samples what it would have without
    it. A failure that no row raises alone is raised, with mx.random's key put back."""
    key = random_key()
    saved = [s.snapshot() for s in samplers]

    def rewind() -> None:
        restore_random_key(key)
        for s, state in zip(samplers, saved):
            s.rewind(state)

    try:
        return (*sample_batch(logits, samplers), {})
    except Exception as e:
        cause = e
    rewind()
    failed = {}
    for i, s in enumerate(samplers):  # only after a failure: each row on its own
        try:
            mx.eval([a for a in sample_batch(logits[i:i + 1], [s]) if a is not None])
        except Exception as e:
            failed[i] = f"{type(e).__name__}: {e}"
        rewind()
    if not failed:
        raise cause
    for i in failed:
        samplers[i] = RowSampler.stand_in(samplers[i].params)
    return (*sample_batch(logits, samplers), failed)


def sample_batch(logits: mx.array, samplers: list[RowSampler]
                 ) -> tuple[mx.array, mx.array | None]:
    """logits: (B, V) -> (B,) token ids, each row with its own sampler, and the logprob records
    of the rows that ask for them, in row order (int32, `logprob_ints` long), else None.

    Rows under a grammar need their matchers to have taken the previous token already: their
    masks are filled on the CPU here, while the device computes `logits`."""
    if all(s.plain for s in samplers):
        return _sample(logits, samplers), None
    if any(s.processors for s in samplers):
        logits = mx.concatenate([s.process(logits[i:i + 1]) if s.processors else logits[i:i + 1]
                                 for i, s in enumerate(samplers)])
    constrained = [i for i, s in enumerate(samplers)
                   if s.grammar is not None and s.grammar.active]
    masked = None
    if constrained:
        mx.async_eval(logits)  # the device computes the step while the CPU fills the masks
        vocab = logits.shape[-1]
        bitmask = fill_masks([samplers[i].grammar for i in constrained], vocab)
        # Only the constrained rows are masked: the others' logits are not even copied.
        masked = (constrained, mx.where(allowed_tokens(bitmask, vocab),
                                        logits[mx.array(constrained)], -mx.inf))
    tokens = _sample(logits, samplers, masked)
    for i, s in enumerate(samplers):
        if s.processors:
            s.remember(tokens[i:i + 1])
    asking = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    if not asking:
        return tokens, None
    rows = mx.array(asking)
    return tokens, logprob_records(logits[rows], tokens[rows],
                                    max(samplers[i].params.logprobs for i in asking))


def _sample(logits: mx.array, samplers: list[RowSampler],
            masked: tuple[list[int], mx.array] | None = None) -> mx.array:
    """`masked`: the constrained rows and their masked logits, sampled instead of their own.
    Greedy rows take their argmax; every other row is drawn in one batched computation."""
    rows, scores = masked or ([], None)
    if len(rows) == len(samplers):
        logits, rows = scores, []
    if all(s.params.greedy for s in samplers):
        tokens = mx.argmax(logits, axis=-1)
        if rows:
            tokens[mx.array(rows)] = mx.argmax(scores, axis=-1)
        return tokens
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    # Unseeded rows first: they share one draw from mx.random's global key.
    drawn = sorted((i for i, s in enumerate(samplers) if not s.params.greedy),
                   key=lambda i: samplers[i].key is not None)
    parts = [_draw(_rows_of(logits, rows, scores, drawn), [samplers[i] for i in drawn])]
    if greedy:
        parts.append(mx.argmax(_rows_of(logits, rows, scores, greedy), axis=-1))
    return _in_row_order(mx.concatenate(parts) if greedy else parts[0], drawn + greedy)


def _in_row_order(x: mx.array, order: list[int]) -> mx.array:
    """x: one entry per row, computed for the rows in `order` -> the same in row order."""
    if order == list(range(len(order))):
        return x
    place = [0] * len(order)
    for at, i in enumerate(order):
        place[i] = at
    return x[mx.array(place)]


def _rows_of(logits: mx.array, rows: list[int], scores: mx.array | None,
             wanted: list[int]) -> mx.array:
    """The logits of rows `wanted`, a constrained row's (`rows`) from `scores`; copies nothing
    when `wanted` is every row and none is constrained."""
    at = {i: j for j, i in enumerate(rows)}
    if not any(i in at for i in wanted):
        return logits if wanted == list(range(logits.shape[0])) else logits[mx.array(wanted)]
    both = mx.concatenate([logits, scores])
    return both[mx.array([logits.shape[0] + at[i] if i in at else i for i in wanted])]


def _check(params: SamplingParams, vocab: int) -> None:
    """Refuses what mlx-lm's apply_top_k and apply_min_p refuse, with their messages."""
    if params.top_k > 0 and not params.top_k < vocab:
        raise ValueError(f"`top_k` has to be an integer in the (0, {vocab}) interval,"
                         f" but is {params.top_k}.")
    if params.min_p > 0.0 and not params.min_p <= 1.0:
        raise ValueError(f"`min_p` has to be a float in the [0, 1] interval, but is "
                         f"{params.min_p}")


def _draw(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """logits: (n, V) of sampled (not greedy) rows, unseeded rows first -> (n,) token ids, each
    row drawn at its temperature from the tokens its filters keep, all rows at once."""
    params = [s.params for s in samplers]
    ids, x, limits = filter_candidates(logits, params)
    unseeded = sum(s.key is None for s in samplers)
    seeded = (_seeded_noise(samplers[unseeded:], logits.shape[-1], x.shape[-1],
                            None if ids is None else ids[unseeded:])
              if unseeded < len(samplers) else None)
    return _pick(x, ids, *limits, mx.array([1.0 / p.temperature for p in params]), seeded)


def filter_candidates(logits: mx.array, params: list[SamplingParams]
                      ) -> tuple[mx.array | None, mx.array, tuple]:
    """The candidates mlx-lm's chain (top-k, then top-p, then min-p, over the log-softmax)
    chooses among for each row of logits (n, V), as (ids, x, limits): their token ids (None:
    every token, in token order), their logits (in float32 when ranked, else as given), and
    the per-row arrays `keep_candidates` filters them by. When every row has a top-k, the
    candidates are each row's K highest logits, K the batch's largest top-k, so all the work
    past finding them is over (n, K), not the vocabulary."""
    vocab = logits.shape[-1]
    for p in params:
        _check(p, vocab)
    top_k = [max(0, p.top_k) for p in params]
    ranked = any(top_k) or any(0.0 < p.top_p < 1.0 for p in params)
    if all(top_k):
        ids, x = _top_candidates(logits, candidate_width(max(top_k), vocab))
    elif ranked:
        ids, x = _ranked(logits)
    else:
        ids, x = None, logits
    ranks = (mx.array([k or x.shape[-1] for k in top_k]),
             mx.array([p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]),
             mx.array([0.0 < p.top_p < 1.0 for p in params])) if ranked else (None, None, None)
    min_p = (mx.array([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params])
             if any(p.min_p > 0.0 for p in params) else None)
    return ids, x, (*ranks, min_p)


def candidate_width(k: int, vocab: int) -> int:
    """How many candidates a batch whose largest top-k is `k` ranks: `k` rounded up to a power
    of two (at most the vocabulary). A compiled function keeps a trace for every width it is
    called with, for as long as the worker runs: clients' top-k values, one width each, grew a
    worker's memory with every new value, where these are at most log2(vocab) + 1. Each row
    still keeps only its own top-k of them (`keep_candidates`)."""
    return min(1 << (k - 1).bit_length(), vocab)


# Candidates for top-k are found through groups of this many logits: the k groups with the
# highest maxima hold the k highest logits, so one cheap max over the vocabulary and a
# partition of k * TOP_K_GROUP logits replace a partition of the whole vocabulary (several
# times slower on a CPU).
TOP_K_GROUP = 32


# The functions below are compiled: a decode step samples through a few dozen small ops, and
# their dispatch, not their arithmetic, is most of what sampling costs a small batch (on a GPU
# each op is a kernel launch: one compiled draw fuses what separate calls launch one by one).
@mx.compile
def _top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """logits: (n, V) -> the ids and float32 values of each row's k highest logits, highest
    first. Found in the logits' own dtype (a float32 cast orders them alike): only the
    candidates are cast, not the vocabulary."""
    n, vocab = logits.shape
    groups = -(-vocab // TOP_K_GROUP)
    x = logits
    if groups > k:
        padded = groups * TOP_K_GROUP
        if padded > vocab:  # -inf past the vocabulary: never above a real logit
            x = mx.concatenate([x, mx.full((n, padded - vocab), -mx.inf, x.dtype)], axis=-1)
        best = mx.argpartition(-x.reshape(n, groups, TOP_K_GROUP).max(axis=-1), k - 1,
                               axis=-1)[:, :k]
        ids = (best[:, :, None] * TOP_K_GROUP + mx.arange(TOP_K_GROUP)).reshape(n, -1)
        values = mx.take_along_axis(x, ids, axis=-1)
    else:
        ids, values = mx.broadcast_to(mx.arange(vocab), x.shape), x
    top = mx.argpartition(-values, k - 1, axis=-1)[:, :k]
    ids, values = mx.take_along_axis(ids, top, axis=-1), mx.take_along_axis(values, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return (mx.take_along_axis(ids, order, axis=-1),
            mx.take_along_axis(values, order, axis=-1).astype(mx.float32))


@mx.compile
def _ranked(logits: mx.array) -> tuple[mx.array, mx.array]:
    """logits: (n, V) -> every token's id and float32 logit, each row highest first."""
    x = logits.astype(mx.float32)
    ids = mx.argsort(-x, axis=-1)
    return ids, mx.take_along_axis(x, ids, axis=-1)


def keep_candidates(x: mx.array, top_k: mx.array | None, top_p: mx.array | None,
                    top_p_on: mx.array | None, log_min_p: mx.array | None) -> mx.array:
    """Which candidates x (n, W, float32) mlx-lm's apply_top_k, apply_top_p and apply_min_p
    keep, by `filter_candidates`'s limits (None: that filter is off for every row). Ranked
    (top_k given), x is sorted, highest first: the row's first top_k, and of those every token
    at least as likely as the least likely one that the probability mass before it leaves under
    top_p (a row whose top_p is not on keeps them all); min-p keeps tokens at least min_p times
    the likeliest."""
    keep = mx.array(True)
    if top_k is not None:
        keep = mx.arange(x.shape[-1])[None] < top_k[:, None]
        ranked = mx.where(keep, x, -mx.inf)
        probs = mx.exp(ranked - ranked[:, :1])  # unnormalised: top-p compares shares of a total
        mass_before = mx.cumsum(probs, axis=-1, inclusive=False)
        total = mass_before[:, -1:] + probs[:, -1:]
        kept = (mass_before < top_p[:, None] * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ranked, mx.maximum(kept - 1, 0), axis=-1)
        keep = keep & (~top_p_on[:, None] | (ranked >= threshold))
    if log_min_p is not None:
        keep = keep & (x >= x.max(axis=-1, keepdims=True) + log_min_p[:, None])
    return keep


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _pick(x: mx.array, ids: mx.array | None, top_k: mx.array | None, top_p: mx.array | None,
          top_p_on: mx.array | None, log_min_p: mx.array | None, inv_temp: mx.array,
          seeded: mx.array | None) -> mx.array:
    """The Gumbel-max draw mx.random.categorical makes, over the candidates `keep_candidates`
    keeps, at each row's temperature: the unseeded rows' noise drawn here from mx.random's
    global key, the seeded rows' (last) given. Returns token ids, uint32."""
    x = x.astype(mx.float32)
    keep = keep_candidates(x, top_k, top_p, top_p_on, log_min_p)
    n, width = x.shape
    unseeded = n - (0 if seeded is None else seeded.shape[0])
    # No draw of zero rows: MLX's CUDA backend dies of a floating point exception on one.
    parts = [mx.random.gumbel((unseeded, width))] if unseeded else []
    if seeded is not None:
        parts.append(seeded)
    noise = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    choice = mx.argmax(mx.where(keep, x * inv_temp[:, None], -mx.inf) + noise, axis=-1)
    if ids is None:
        return choice
    return mx.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(mx.uint32)


_split_keys = mx.vmap(mx.random.split)


def _seeded_noise(samplers: list[RowSampler], vocab: int, width: int,
                  ids: mx.array | None) -> mx.array:
    """Each seeded row's noise (n, width), drawn from its key after splitting it, and depending on
    nothing but the row: over its top-k (highest first) when it has one, else over the vocabulary
    in token order (then taken at its candidates `ids`). Rows drawing as many values share one
    vectorised draw."""
    keys = _split_keys(mx.stack([s.key for s in samplers]))
    for j, s in enumerate(samplers):
        s.key = keys[j, 0]
    sizes = [s.params.top_k if s.params.top_k > 0 else vocab for s in samplers]
    rows, parts = [], []
    for size in sorted(set(sizes)):
        group = [j for j, n in enumerate(sizes) if n == size]
        noise = mx.vmap(lambda key, n=size: mx.random.gumbel((n,), key=key))(
            keys[mx.array(group), 1])
        if size == vocab and ids is not None:
            noise = mx.take_along_axis(noise, ids[mx.array(group)], axis=-1)
        rows += group
        parts.append(mx.pad(noise, [(0, 0), (0, width - noise.shape[-1])]))
    return _in_row_order(mx.concatenate(parts) if len(parts) > 1 else parts[0], rows)


def logprob_records(logits: mx.array, tokens: mx.array, k: int) -> mx.array:
    """(n, V) logits of the asking rows and their sampled tokens -> n records of 1 + 2k int32:
    the token's logprob, the k most likely ids (most likely first), their logprobs; floats as
    their float32 bit patterns, so one int32 message carries them with the tokens."""
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    parts = [mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1).view(mx.int32)]
    if k:
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        values = mx.take_along_axis(lp, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        parts += [mx.take_along_axis(top, order, axis=-1).astype(mx.int32),
                  mx.take_along_axis(values, order, axis=-1).view(mx.int32)]
    return mx.concatenate(parts, axis=-1).reshape(-1)


def logprob_ints(ks: list[int]) -> int:
    """Length of the logprob records of rows asking for `ks` alternatives each."""
    return len(ks) * (1 + 2 * max(ks)) if ks else 0


def pack_logprobs(records: list[Logprob], k_max: int) -> list[int]:
    """`unpack_logprobs`' inverse: records of rows asking for up to `k_max` alternatives, as
    the ints `sample_batch` makes them (1 + 2 * k_max each)."""
    out = []
    for r in records:
        pad = [0] * (k_max - len(r.top_ids))
        out += [*np.array([r.logprob], dtype=np.float32).view(np.int32).tolist(),
                *r.top_ids, *pad,
                *np.array(r.top_logprobs, dtype=np.float32).view(np.int32).tolist(), *pad]
    return out


def unpack_logprobs(ints: list[int], ks: list[int]) -> list[Logprob]:
    """The records `sample_batch` made for rows asking for `ks` alternatives, in row order."""
    width, k_max = 1 + 2 * max(ks, default=0), max(ks, default=0)
    out = []
    for j, k in enumerate(ks):
        rec = ints[j * width:(j + 1) * width]
        floats = np.array([rec[0], *rec[1 + k_max:1 + k_max + k]], dtype=np.int32).view(np.float32)
        out.append(Logprob(float(floats[0]), rec[1:1 + k], floats[1:].tolist()))
    return out
