"""Per-sequence sampling over a batch of logits.

Every row of a batch may carry its own temperature, top-p, top-k, min-p and seed. Greedy rows take
the argmax of the raw logits, exactly what mlx-lm's default sampler picks. A seeded row owns a
PRNG key that is split once per token, so its output depends only on its seed and its logits,
never on which other sequences shared the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class RowSampler:
    """The sampling state of one sequence: its parameters and, when seeded, its PRNG key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.key = mx.random.key(params.seed) if params.seed is not None else None

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


def sample_batch(logits: mx.array, samplers: list[RowSampler]) -> mx.array:
    """logits: (B, V) -> (B,) token ids, each row with its own sampler."""
    if all(s.params.greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.stack([s(logits[i]) for i, s in enumerate(samplers)])
