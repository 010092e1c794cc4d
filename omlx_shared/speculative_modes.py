"""The speculative decoding modes a model can be served with (omlx_node/speculation.py):
"off" (no drafts, a request's prediction unused too), "ngram" (prompt lookup drafts, and a
request's prediction), "auto" (ngram where the node measures that drafts can pay)."""

from __future__ import annotations

MODES = ("off", "ngram", "auto")


def check_mode(mode: str) -> str:
    """`mode` if it names a speculation mode; ValueError saying which do otherwise."""
    if mode not in MODES:
        raise ValueError(f"unknown speculative mode {mode!r}: use one of {', '.join(MODES)}")
    return mode
