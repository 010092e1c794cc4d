"""Speculative decoding in one node's engine: who drafts tokens, and which of them stand.

A row of the batch may carry a draft of its next k tokens. The engine runs the row's input and
its draft as k+1 positions of one forward pass; the target model's logits at each position then
say how many of the draft stand (`verify_greedy`, `verify_sampled`) and give one more token of
its own: a row gets 1 to k+1 tokens for one pass over the weights, which batch-1 decoding,
bound by reading those weights, pays once either way.

Drafts come from a `Proposer`:
- `NgramProposer` (prompt lookup): the last n tokens of the row (prompt and output, n from 3
  down to 1) are looked up, latest occurrence first, in the same tokens; what followed them there
  is the draft. An agent that rewrites a file it just read gets most of it drafted for free.
- `PredictionProposer`: OpenAI's predicted outputs; the draft is looked up in the text the
  client predicted (the file being edited), starting at its beginning.
- a draft model's (`omlx_node.draft_model`, `--speculative draft=PATH`): a small model of the
  same tokenizer, with each row in its own KV cache, drafts greedily.

Acceptance keeps the target's output exactly: greedy rows keep the draft's longest prefix that
equals the argmax at each position (the same tokens as decoding one by one, up to the rounding
of a k+1-position pass, as mlx-lm's speculative_generate_step); sampled rows use rejection
sampling for a deterministic draft: token t stands with probability p(t), else the position
draws from p with t removed and renormalised, and the output is distributed exactly as p.

Which rows draft: unconstrained, unpenalised rows that are greedy or unseeded (a grammar's
matcher and a penalty's history would have to follow every drafted token, and a seeded row's
tokens must not depend on whether its batch was small enough to speculate); the others decode
one token a step, in the same pass.
Speculation steps aside when the batch holds more than `max_rows` rows: a batch that size is
bound by compute rather than by reading the weights, and extra positions cost what they save.
Where even one row's k+1 positions cost several times one position (a CPU whose matrix
products are compute bound), no draft pays: "auto" measures that at start-up
(`verify_cost`, one layer's MLP, as micro-batching measures its cost curve) and drafts only
where k+1 positions cost at most AUTO_MAX_COST one-position steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from omlx_node.calibrate import row_costs
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import (
    Logprob,
    RowSampler,
    SamplingParams,
    filter_candidates,
    keep_candidates,
    logprob_records,
    sample_rows,
    unpack_logprobs,
)
from omlx_node.stage import StageRunner
from omlx_shared.speculative_modes import check_mode, draft_path

DRAFT_TOKENS = 4  # k: the most a row drafts in one step
# Speculation steps aside above this many rows: a batch's step grows less bound by reading
# the weights with every row, and k more positions a row start to cost what they save. A fixed
# guess, not yet a measured crossover (docs/speculative.md).
MAX_ROWS = 4
NGRAM_MAX, NGRAM_MIN = 3, 1
# "auto" drafts where a step of k+1 positions costs at most this many steps of one: then a
# row whose drafts stand about half the time (k=4: 3 tokens a step) still gains.
AUTO_MAX_COST = 2.0
# A row whose draft all failed waits 2, 4, ... up to this many steps before it drafts again:
# a step that may draft waits for the row's last token (no overlap with the step before), so
# a text that prompt lookup does not predict should not pay that, nor the wasted positions.
MAX_BACKOFF = 16

log = logging.getLogger(__name__)


def verify_cost(stage: StageRunner, k: int = DRAFT_TOKENS) -> float:
    """What one row's step of k+1 positions costs on this device, in steps of one position:
    about 1 where decoding is bound by reading the weights (a GPU, Apple silicon), about k+1
    where the matrix products are compute bound (a CPU's reference BLAS)."""
    costs = row_costs(stage.feed_forward(), stage.hidden_size, stage.info.dtype,
                      rows=(1, k + 1))
    return costs[k + 1] / costs[1]


def lookup(corpus: np.ndarray, end: int, suffix: np.ndarray, k: int, after: int = 0
           ) -> tuple[list[int], int]:
    """What follows an occurrence of `suffix` in corpus[:end] (up to k tokens, within
    corpus[:end]), and where that continuation starts; ([], 0) when none has one. The first
    occurrence whose continuation starts at or past `after` (where the last draft read on: a
    copy goes on where it was), else the latest."""
    n = len(suffix)
    if n == 0 or end <= n:
        return [], 0
    windows = np.lib.stride_tricks.sliding_window_view(corpus[:end - 1], n)
    hits = np.flatnonzero((windows == suffix).all(axis=1)) + n
    if not len(hits):
        return [], 0
    onward = hits[hits >= after]
    start = int(onward[0] if len(onward) else hits[-1])
    return corpus[start:min(start + k, end)].tolist(), start


class Proposer:
    """Drafts the next tokens of one row; one per row (it may remember where it read)."""

    source = ""  # what its last draft is counted as: "ngram" or "prediction"

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the row's prompt then its `output`)."""
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup over the row's own tokens, prompt and output."""

    source = "ngram"

    def __init__(self) -> None:
        self.cursor = 0

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(seq) > n:
                draft, start = lookup(seq, len(seq), seq[-n:], k, self.cursor)
                if draft:
                    self.cursor = start + 1
                    return draft
        return []


class PredictionProposer(Proposer):
    """OpenAI's predicted outputs: the draft is read from the client's predicted text, else
    (where the output has left it) looked up in the row's own tokens, as prompt lookup does."""

    def __init__(self, prediction: Sequence[int]):
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.cursor = 0
        self.own = NgramProposer()

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        self.source = "prediction"
        if not output:
            return self.prediction[:k].tolist()
        out = np.asarray(output[-NGRAM_MAX:], dtype=np.int64)
        for n in range(min(NGRAM_MAX, len(out)), NGRAM_MIN - 1, -1):
            draft, start = lookup(self.prediction, len(self.prediction), out[-n:], k,
                                  self.cursor)
            if draft:
                self.cursor = start + 1
                return draft
        self.source = "ngram"
        return self.own.propose(tokens, output, k)


@dataclass
class Verdict:
    """What one row's verification gives: the draft tokens that stand, then the target's own
    next token (the one that replaces the first rejected draft token, or follows them all),
    and when the row asks for them, the logprobs of each of those tokens in order."""

    accepted: list[int]
    token: int
    logprobs: list[Logprob] | None = None


def verify_greedy(targets: Sequence[int], draft: Sequence[int]) -> Verdict:
    """`targets`: the argmax at each of the row's len(draft)+1 positions."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return Verdict(list(draft[:a]), int(targets[a]))


def verify_sampled(probs: np.ndarray, draft: Sequence[int], uniforms: np.ndarray) -> Verdict:
    """Rejection sampling of a deterministic draft. `probs` (len(draft)+1, V): the target's
    distribution at each position (the row's filters and temperature applied); `uniforms`:
    2 * (len(draft) + 1) draws from U[0, 1), the row's randomness for this step."""
    for j, t in enumerate(draft):
        p = probs[j].astype(np.float64)
        if uniforms[2 * j] < p[t]:
            continue
        residual = p.copy()
        residual[t] = 0.0
        return Verdict(list(draft[:j]), _draw(residual, uniforms[2 * j + 1]))
    d = len(draft)
    return Verdict(list(draft), _draw(probs[d].astype(np.float64), uniforms[2 * d + 1]))


def _draw(weights: np.ndarray, u: float) -> int:
    """The token at which `u` of the way through weights' total mass falls (inverse CDF)."""
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """logits (n, V) -> (n, V) float32: the distribution a sampled row draws each token from
    (sampling._draw's: mlx-lm's top-k, top-p and min-p filters, then its temperature)."""
    n, vocab = logits.shape
    ids, x, limits = filter_candidates(logits, [params] * n)
    keep = keep_candidates(x.astype(mx.float32), *limits)
    p = mx.softmax(mx.where(keep, x.astype(mx.float32) / params.temperature, -mx.inf), axis=-1)
    if ids is None:
        return p
    return mx.put_along_axis(mx.zeros((n, vocab), mx.float32), ids.astype(mx.int32), p, axis=-1)




def trim_rows(caches: list, extra: Sequence[int]) -> None:
    """Drops each row's last extra[i] positions from a decode step's layer caches: the
    rejected draft tokens (and a short draft's filler). A one-row KVCache trims its offset;
    a BatchKVCache trims what every row drops, then shifts each row right by the rest, into
    its left padding (mlx-lm's own right-padding finalize), so no row keeps a rejected token."""
    common = min(extra)
    for c in caches:
        if common:
            c.trim(common)
        if not isinstance(c, BatchKVCache) or max(extra) == common:
            continue
        c._right_padding = mx.array([e - common for e in extra])
        c.finalize()


def verify_rows(logits: mx.array, drafts: list[list[int]], samplers: list[RowSampler]
                ) -> tuple[list[Verdict], dict[int, str]]:
    """One step's verdicts from its logits (B, L, V). A row with a draft keeps what
    verification gives; a row without one samples position 0 as a plain step would
    (`sample_rows`: its penalties, grammar and failures its own; a failed row gets a stand-in
    in `samplers` and its error in the returned dict, by row index)."""
    plain = [i for i, d in enumerate(drafts) if not d]
    verdicts: list[Verdict | None] = [None] * len(drafts)
    failed: dict[int, str] = {}
    if plain:
        subset = [samplers[i] for i in plain]
        tokens, records, errors = sample_rows(logits[mx.array(plain), 0, :], subset)
        for j, i in enumerate(plain):
            samplers[i] = subset[j]  # a stand-in where its own failed
        failed = {plain[j]: e for j, e in errors.items()}
        asking = [i for i in plain if samplers[i].params.logprobs is not None]
        records = unpack_logprobs(records.tolist(), [samplers[i].params.logprobs
                                                     for i in asking]) if asking else []
        found = dict(zip(asking, records))
        for i, t in zip(plain, tokens.tolist()):
            verdicts[i] = Verdict([], t, [found[i]] if i in found else None)
    drafted = [i for i, d in enumerate(drafts) if d]
    greedy = [i for i in drafted if samplers[i].params.greedy]
    targets = mx.argmax(logits[mx.array(greedy)], axis=-1).tolist() if greedy else []
    for i, row_targets in zip(greedy, targets):
        verdicts[i] = verify_greedy(row_targets, drafts[i])
    for i in drafted:
        if verdicts[i] is None:
            s, d = samplers[i], drafts[i]
            probs = target_probs(logits[i, :len(d) + 1], s.params)
            u = mx.random.uniform(shape=(2 * (len(d) + 1),))  # unseeded: the global key
            verdicts[i] = verify_sampled(np.array(probs), d, np.array(u))
        k = samplers[i].params.logprobs
        if k is not None:
            v = verdicts[i]
            out = [*v.accepted, v.token]
            ints = logprob_records(logits[i, :len(out)], mx.array(out), k).tolist()
            v.logprobs = unpack_logprobs(ints, [k] * len(out))
    return verdicts, failed


class Speculator:
    """An engine's speculation: its mode and limits, each row's proposer, and the counts
    /metrics shows."""

    def __init__(self, mode: str, stage: StageRunner, metrics: NodeMetrics | None = None,
                 k: int = DRAFT_TOKENS, max_rows: int = MAX_ROWS,
                 drafter: Callable[[], Proposer] | None = None):
        """`stage`: the model, whose step cost "auto" measures; `drafter`: makes a row's
        draft model proposer ("draft=PATH" modes: omlx_node.draft_model)."""
        self.k, self.max_rows, self.metrics = k, max_rows, metrics
        self.drafter = drafter if draft_path(check_mode(mode)) else None
        if draft_path(mode) and drafter is None:
            raise ValueError(f"speculative mode {mode!r} needs its draft model loaded")
        self.on = mode == "ngram" or self.drafter is not None
        if mode == "auto":
            cost = verify_cost(stage, k)
            self.on = cost <= AUTO_MAX_COST
            log.info("speculative decoding %s: a step of %d positions costs %.1f of one "
                     "(auto drafts up to %.1f)", "on" if self.on else "off", k + 1, cost,
                     AUTO_MAX_COST)

    def wanted(self, stats: list[SpecStats]) -> bool:
        """Whether a step of rows with these stats (those that have a proposer) may draft: a
        batch small enough, and a row not backing off. Counts the step off each row's wait."""
        if len(stats) > self.max_rows:
            return False
        ready = False
        for s in stats:
            if s.wait:
                s.wait -= 1
            else:
                ready = True
        return ready

    def proposer(self, prediction: Sequence[int]) -> Proposer | None:
        """A new row's proposer, while speculation is on: its prediction's when it sent one,
        else the draft model's where there is one, else prompt lookup."""
        if not self.on:
            return None
        if prediction:
            return PredictionProposer(prediction)
        return self.drafter() if self.drafter is not None else NgramProposer()

    def draft(self, proposer: Proposer | None, stats: SpecStats, sampler: RowSampler,
              tokens: Sequence[int], output: Sequence[int], room: int) -> list[int]:
        """A row's draft for this step: none for a row under a grammar or penalties (their
        state would have to follow each drafted token), for a seeded sampled row (its tokens
        depend on its seed alone, and a step that verifies a draft spends its key otherwise
        than one that does not: which one it gets depends on the batch's size) or with no
        `room` (tokens it may still generate beyond the one this step gives it anyway), nor
        for one backing off after drafts that all failed."""
        if (proposer is None or stats.wait or sampler.processors or sampler.grammar is not None
                or (sampler.key is not None and not sampler.params.greedy)):
            return []
        return proposer.propose(tokens, output, min(self.k, room)) if room > 0 else []

    def counted(self, proposer: Proposer, stats: SpecStats, drafted: int, accepted: int) -> None:
        """Counts one row's verified draft, in its stats and /metrics."""
        stats.drafted += drafted
        stats.accepted += accepted
        stats.misses = 0 if accepted else stats.misses + 1
        stats.wait = min(2 ** stats.misses, MAX_BACKOFF) if stats.misses else 0
        if proposer.source == "prediction":
            stats.predicted_drafted += drafted
            stats.predicted_accepted += accepted
        if self.metrics is not None:
            self.metrics.speculated(proposer.source, drafted, accepted)


@dataclass
class SpecStats:
    """One row's drafts so far: tokens proposed, and those that stood, by source."""

    drafted: int = 0
    accepted: int = 0
    predicted_drafted: int = 0  # of them, read from the client's prediction
    predicted_accepted: int = 0
    misses: int = 0  # drafts in a row none of which stood
    wait: int = 0  # steps left before it drafts again
