"""How long new requests wait to start together on a stage that streams layers from disk.

A stage that keeps layers on disk (layer_stream.py) reads them once per forward pass, whatever
the rows: the read is shared by the batch. Requests that arrive a few milliseconds apart at an
idle engine would otherwise start one pass apart: the first prefills alone, decodes alone while
the next prefills, and so on, each pass paying the whole read again. So on such a stage a new
request waits, at most `window` seconds from the arrival of the oldest one not started, for
others to join it; they then prefill in the same iteration (one forward pass where their
prompts line up, StageState.prefill_rows) and decode in the same steps from their first token.

The window is a share of what a pass over the streamed layers costs, as last measured: waiting
`share * pass` for a request that would otherwise cost one more pass pays while share < 1, and
the first request's first token is late by at most that. A cap bounds it where a pass is long
(a slow disk). A stage that streams nothing never waits.
"""

from __future__ import annotations

# Half a pass: a row that joins saves a whole one; the first waits at most half of one.
SHARE = 0.5
MAX_WINDOW_S = 1.0


def gather_window(pass_seconds: float, share: float = SHARE, cap: float = MAX_WINDOW_S) -> float:
    """Seconds new requests may wait for others on a stage whose streamed layers take
    `pass_seconds` a forward pass (0: it streams none, or has not been measured)."""
    return min(cap, share * pass_seconds) if pass_seconds > 0 else 0.0


def wait_left(window: float, now: float, oldest: float, new: int, room: int) -> float:
    """Seconds the `new` requests not started yet (the oldest arrived at `oldest`) still wait
    for others, with `room` rows free in the batch: 0 once the window has passed or they fill
    the room."""
    if window <= 0 or new == 0 or new >= room:
        return 0.0
    return max(0.0, oldest + window - now)
