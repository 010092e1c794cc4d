"""Prompt token ids checked against a vocabulary, by the gateway and by the engine alike."""

from __future__ import annotations

from collections.abc import Sequence


def outside_vocabulary(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids not in [0, vocab_size), in order. min/max first: a scan at C speed, where a
    long prompt's Python loop would add to every request's first token."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return []
    return [t for t in ids if not 0 <= t < vocab_size]
