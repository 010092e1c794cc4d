"""How many prompt tokens an engine iteration may prefill while other sequences decode.

An iteration runs one decode step for the running rows and then one prefill chunk. With a fixed
chunk (512 tokens on a CPU) every decoding stream waited for the whole chunk each step: on the
2-core CPU a 512-token chunk took 10-40 decode steps' time, and a session decoding while others
prefilled kept 4-9% of its plain decode rate (bench/agent_sessions.py, before pacing). An agent
waits for its whole turn, the first token and then every other one, so the prefill of one turn
must not stop the decoding of the others.

`StepPace` measures, on the engine's own iterations, what a decode step costs (its rows and
their context as they are now) and what a prefilled token costs, and sizes the chunk so that
the prefill takes at most `share` decode steps' time: a decoding stream keeps at least
1 / (1 + share) of its rate. Alone (nobody decoding) a prompt gets the whole chunk. A floor of
`min_tokens` keeps a prompt moving when a token costs more than a step (the per-chunk overhead
would otherwise be paid for a handful of tokens). The measurements are moving averages: step
costs grow with the batch and its context, and the machine's load changes under them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why 1.0 (a decoding stream keeps half its rate) and a floor of 8: measured, docs/scheduling.md.
DEFAULT_SHARE = 1.0
MIN_TOKENS = 8
SMOOTHING = 0.2  # weight of the newest iteration in the moving averages


@dataclass
class StepPace:
    share: float = DEFAULT_SHARE
    min_tokens: int = MIN_TOKENS
    decode_s: float = 0.0  # seconds of a decode step, 0 until measured
    token_s: float = 0.0  # seconds of a prefilled token, 0 until measured

    def observe(self, seconds: float, decoded: bool, prefilled: int) -> None:
        """One iteration took `seconds`: a decode step if `decoded`, and `prefilled` tokens."""
        if decoded and not prefilled:
            self.decode_s = _average(self.decode_s, seconds)
        elif prefilled:
            rest = seconds - (self.decode_s if decoded else 0.0)
            self.token_s = _average(self.token_s, max(rest, 0.0) / prefilled)

    def budget(self, chunk: int, decoding: bool) -> int:
        """Prompt tokens for this iteration's prefill, at most `chunk`."""
        if not decoding or not (self.decode_s and self.token_s):
            return chunk
        return max(min(chunk, self.min_tokens), min(chunk, int(self.share * self.decode_s
                                                               / self.token_s)))


def _average(old: float, new: float) -> float:
    return new if not old else (1 - SMOOTHING) * old + SMOOTHING * new
