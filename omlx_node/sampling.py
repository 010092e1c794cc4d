"""Per-sequence sampling over a batch of logits.

Every row of a batch may carry its own temperature, top-p, top-k, min-p and seed. Greedy rows take
the argmax of the raw logits, exactly what mlx-lm's default sampler picks. A seeded row owns a
PRNG key that is split once per token, so its output depends only on its seed and its logits,
never on which other sequences shared the batch.

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
that row alone, and the others sample exactly what they would have. mlx-lm's filters are compiled
with mx.random's global key as an input and an output, so one that raises while tracing leaves a
placeholder key behind that no later unseeded sample can evaluate ("array without a primitive"):
every failure puts the key back (`random_key`, `restore_random_key`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

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

    def __call__(self, logits: mx.array) -> mx.array:
        """logits: (V,) -> a scalar token id."""
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = (logits - mx.logsumexp(logits, keepdims=True))[None]
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        key = None
        if self.key is not None:
            self.key, key = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=key)[0]


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
    return tokens, _logprob_records(logits[rows], tokens[rows],
                                    max(samplers[i].params.logprobs for i in asking))


def _sample(logits: mx.array, samplers: list[RowSampler],
            masked: tuple[list[int], mx.array] | None = None) -> mx.array:
    """`masked`: the constrained rows and their masked logits, sampled instead of their own."""
    rows, scores = masked or ([], None)
    if len(rows) == len(samplers):
        logits, rows = scores, []
    if all(s.params.greedy for s in samplers):
        tokens = mx.argmax(logits, axis=-1)
        if rows:
            tokens[mx.array(rows)] = mx.argmax(scores, axis=-1)
        return tokens
    at = {i: j for j, i in enumerate(rows)}
    return mx.stack([s(scores[at[i]] if i in at else logits[i]) for i, s in enumerate(samplers)])


def _logprob_records(logits: mx.array, tokens: mx.array, k: int) -> mx.array:
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


def unpack_logprobs(ints: list[int], ks: list[int]) -> list[Logprob]:
    """The records `sample_batch` made for rows asking for `ks` alternatives, in row order."""
    width, k_max = 1 + 2 * max(ks, default=0), max(ks, default=0)
    out = []
    for j, k in enumerate(ks):
        rec = ints[j * width:(j + 1) * width]
        floats = np.array([rec[0], *rec[1 + k_max:1 + k_max + k]], dtype=np.int32).view(np.float32)
        out.append(Logprob(float(floats[0]), rec[1:1 + k], floats[1:].tolist()))
    return out
