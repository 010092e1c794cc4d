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

How much a row drafts adapts to it: each row keeps a running estimate of the share of its
drafted tokens that stand (alpha, recent steps weighing most), and drafts the k (1..k_max)
that gives the most tokens per unit of cost: a step of k+1 positions gives
1 + alpha + ... + alpha^k tokens and costs what the start-up curve says k+1 positions cost
(plus, with a draft model, k of its passes). Speculation steps aside when the batch holds more
rows than `max_rows`, the crossover measured at start-up as micro-batching measures its cost
curve (`position_costs`, one layer's MLP on 1 to 256 positions): the most rows B whose
B(k+1) positions cost at most AUTO_MAX_COST times B positions. Past it a step is bound by
compute rather than by reading the weights, and drafts cost what they save. Where not even
one row's k+1 positions are that cheap (a CPU whose matrix products are compute bound), no
draft pays: "auto" stays off; "ngram" and "draft=PATH" still draft one row at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import mlx.core as mx
import numpy as np

from omlx_node.calibrate import row_costs, step_cost
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

DRAFT_TOKENS = 4  # k_max: the most a row drafts in one step
NGRAM_MAX, NGRAM_MIN = 3, 1
# A step of B rows speculates while B(k+1) positions cost at most this many steps of B: then a
# row whose drafts stand about half the time (k=4: about 2 tokens a step) still gains.
AUTO_MAX_COST = 2.0
# What the start-up cost curve measures, in positions of one step (rows times width).
COST_POSITIONS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256)
# A row whose draft all failed waits 2, 4, ... up to this many steps before it drafts again:
# a step that may draft waits for the row's last token (no overlap with the step before), so
# a text that prompt lookup does not predict should not pay that, nor the wasted positions.
MAX_BACKOFF = 16
# A row's acceptance estimate: each step's counts weigh this much less at the next; it starts
# as PRIOR_HITS of PRIOR_TRIES drafted tokens standing.
DECAY = 0.8
PRIOR_HITS, PRIOR_TRIES = 1.0, 2.0

log = logging.getLogger(__name__)

# Each stage's `position_costs`, measured once.
_measured: WeakKeyDictionary[StageRunner, dict[int, float]] = WeakKeyDictionary()


def verify_cost(stage: StageRunner, k: int = DRAFT_TOKENS) -> float:
    """What one row's step of k+1 positions costs on this device, in steps of one position:
    about 1 where decoding is bound by reading the weights (a GPU, Apple silicon), about k+1
    where the matrix products are compute bound (a CPU's reference BLAS)."""
    costs = row_costs(stage.feed_forward(), stage.hidden_size, stage.info.dtype,
                      rows=(1, k + 1))
    return costs[k + 1] / costs[1]


def position_costs(stage: StageRunner) -> dict[int, float]:
    """Seconds one layer's MLP takes on 1 to 256 positions (COST_POSITIONS, as far as a
    second's budget goes): what a step of that many positions costs on this device. Measured
    once a stage: a worker measures it while it loads, on its loading thread at the load's
    priority (omlx_node.worker), and its engine's Speculator reads the same curve back, so that
    a second of timings does not run at the serving thread's priority beside a neighbour's
    decode."""
    if stage not in _measured:
        _measured[stage] = row_costs(stage.feed_forward(), stage.hidden_size, stage.info.dtype,
                                     rows=COST_POSITIONS, budget_seconds=1.0)
    return _measured[stage]


def collective_position_costs(stage: StageRunner) -> dict[int, float]:
    """`position_costs` on a tensor-parallel stage, run by every rank at once: each call of
    its sharded MLP ends in an all_sum, so every rank makes the same calls, up to 64 positions
    and with no time budget (which would end the ranks' loops at different sizes)."""
    return row_costs(stage.feed_forward(), stage.hidden_size, stage.info.dtype,
                     rows=tuple(r for r in COST_POSITIONS if r <= 64),
                     budget_seconds=float("inf"))


def crossover(costs: dict[int, float], k: int, limit: int) -> int:
    """The most rows (up to `limit`) a step may hold and still speculate: the largest B whose
    B(k+1) positions cost at most AUTO_MAX_COST times B positions; 0 when one row's do not."""
    rows = 0
    while rows < limit and (step_cost(costs, (rows + 1) * (k + 1))
                            <= AUTO_MAX_COST * step_cost(costs, rows + 1)):
        rows += 1
    return rows


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step gives a row that drafts k tokens each standing with probability alpha
    (given those before it stood): 1 + alpha + ... + alpha^k."""
    return sum(alpha ** i for i in range(k + 1))


def best_k(alpha: float, costs: dict[int, float], k_max: int, draft_share: float) -> int:
    """The draft length (1..k_max) with the most tokens per unit of cost for a row of
    acceptance alpha: k+1 positions cost costs' k+1 over its 1, plus k draft-model passes of
    `draft_share` of a target pass each (0 for prompt lookup)."""
    one = step_cost(costs, 1)
    return max(range(1, k_max + 1), key=lambda k: (
        expected_tokens(alpha, k) / (step_cost(costs, k + 1) / one + draft_share * k), -k))


def lookup(corpus: np.ndarray, end: int, suffix: np.ndarray, k: int, after: int = 0
           ) -> tuple[list[int], int]:
    """What follows an occurrence of `suffix` in corpus[:end] (up to k tokens, within
    corpus[:end]), and where that continuation starts; ([], 0) when none has one. The first
    occurrence whose continuation starts at or past `after` (where the last draft read on: a
    copy goes on where it was), else the latest."""
    n = len(suffix)
    if n == 0 or end <= n:
        return [], 0
    # The windows of corpus[:end - 1] that equal the suffix, one shifted compare a token of it:
    # a step drafts on the critical path, over a prompt of up to tens of thousands of tokens
    # (a strided view's .all() over the windows costs far more at that length than this).
    starts = end - n
    match = corpus[:starts] == suffix[0]
    for j in range(1, n):
        match &= corpus[j:starts + j] == suffix[j]
    hits = np.flatnonzero(match) + n
    if not len(hits):
        return [], 0
    onward = hits[hits >= after]
    start = int(onward[0] if len(onward) else hits[-1])
    return corpus[start:min(start + k, end)].tolist(), start


class Proposer:
    """Drafts the next tokens of one row; one per row (it may remember where it read)."""

    source = ""  # what its last draft is counted as: "ngram" or "prediction"

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `tokens` (the row's prompt then its `output`; they
        grow from one call to the next)."""
        raise NotImplementedError

    def feed(self, tokens: Sequence[int]) -> None:
        """Takes the row's prompt as far as it is prefilled (`tokens`, all of it so far): a
        proposer that computes on it (a draft model) does so alongside the prefill."""


class NgramProposer(Proposer):
    """Prompt lookup over the row's own tokens, prompt and output."""

    source = "ngram"

    def __init__(self) -> None:
        self.cursor = 0
        self._held = np.zeros(0, dtype=np.int64)  # the row's tokens so far, and room to grow
        self._count = 0

    def _tokens(self, tokens: Sequence[int]) -> np.ndarray:
        """`tokens` as an array, only what is new converted: a row's tokens only grow (its
        prompt, then its output), and converting them all every step costs more as they grow.
        Another sequence (shorter, or ending otherwise where the last one ended) is taken
        whole."""
        have = self._count
        if len(tokens) < have or (have and tokens[have - 1] != self._held[have - 1]):
            have = 0
        need = len(tokens)
        if need > len(self._held):
            grown = np.zeros(max(need, 2 * len(self._held)), dtype=np.int64)
            grown[:have] = self._held[:have]
            self._held = grown
        self._held[have:need] = tokens[have:need]
        self._count = need
        return self._held[:need]

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        seq = self._tokens(tokens)
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
                 k: int = DRAFT_TOKENS, drafter: Callable[[], Proposer] | None = None, draft_share: float = 0.0,
                 costs: dict[int, float] | None = None, max_batch: int = 64,
                 max_rows: int | None = None):
        """`stage`: the model, whose cost curve is measured here unless `costs` gives it;
        `max_rows`: the most rows a drafting step holds (None: the measured crossover);
        `drafter`: makes a row's draft model
        proposer ("draft=PATH" modes: omlx_node.draft_model), whose pass costs `draft_share`
        of the target's."""
        self.k, self.metrics, self.draft_share = k, metrics, draft_share
        self.drafter = drafter if draft_path(check_mode(mode)) else None
        if draft_path(mode) and drafter is None:
            raise ValueError(f"speculative mode {mode!r} needs its draft model loaded")
        self.on = mode != "off"
        self.costs = costs or ({1: 1.0, 2: 1.0} if mode == "off" else position_costs(stage))
        measured = crossover(self.costs, k, max_batch)
        if mode == "auto":
            self.on = measured > 0
        # An explicit mode drafts at least one row at a time, whatever the curve says.
        self.max_rows = max_rows or max(measured, 1)
        if self.on:
            log.info("speculative decoding on (%s): up to %d rows a step; %d positions cost "
                     "%.1f of one", mode, self.max_rows, k + 1,
                     step_cost(self.costs, k + 1) / step_cost(self.costs, 1))
        elif mode == "auto":
            log.info("speculative decoding off: a step of %d positions costs %.1f of one "
                     "(auto drafts up to %.1f)", k + 1,
                     step_cost(self.costs, k + 1) / step_cost(self.costs, 1), AUTO_MAX_COST)
        if metrics is not None:
            metrics.spec_max_rows.set(self.max_rows if self.on else 0)

    def wanted(self, stats: list[SpecStats], rows: int) -> bool:
        """Whether a step of `rows` rows, these of which (`stats`) have a proposer, may draft:
        a batch small enough, and a row not backing off. Counts the step off each row's
        wait."""
        if rows > self.max_rows:
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

    def draft(self, proposer: Proposer | None, stats: SpecStats, params: SamplingParams,
              constrained: bool, tokens: Sequence[int], output: Sequence[int], room: int
              ) -> list[int]:
        """A row's draft for this step, as long as its acceptance makes worth it: none for a
        row under a grammar or penalties (their state would have to follow each drafted
        token), for a seeded sampled row (its tokens depend on its seed alone, and a step
        that verifies a draft spends its key otherwise than one that does not: which one it
        gets depends on the batch's size) or with no `room` (tokens it may still generate
        beyond the one this step gives it anyway), nor for one backing off after drafts that
        all failed."""
        if (proposer is None or stats.wait or params.penalized or constrained
                or (params.seed is not None and not params.greedy)):
            return []
        share = self.draft_share if proposer.source == "draft" else 0.0
        k = min(best_k(stats.alpha, self.costs, self.k, share), room)
        if k <= 0:
            return []
        # Timed apart from the layers: the rebalancer takes it off the stage's step time
        # before it derives the node's speed from it.
        t0 = time.perf_counter()
        draft = proposer.propose(tokens, output, k)
        if self.metrics is not None:
            self.metrics.profile.drafted(time.perf_counter() - t0)
        return draft

    def counted(self, proposer: Proposer, stats: SpecStats, drafted: int, accepted: int) -> None:
        """Counts one row's verified draft, in its stats and /metrics."""
        stats.drafted += drafted
        stats.accepted += accepted
        # Each drafted token up to the first rejected one was a trial.
        stats.hits = stats.hits * DECAY + accepted
        stats.tries = stats.tries * DECAY + accepted + (accepted < drafted)
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
    hits: float = PRIOR_HITS  # drafted tokens that stood, recent steps weighing most
    tries: float = PRIOR_TRIES  # drafted tokens tried (up to each step's first rejected one)

    @property
    def alpha(self) -> float:
        """The chance its next drafted token stands, as its recent drafts say."""
        return self.hits / self.tries
