"""How many prompt tokens an engine iteration may prefill while other sequences decode.

An iteration runs one decode step for the running rows and then one prefill chunk. With a fixed
chunk every decoding stream waited for the whole chunk each step: a full chunk costs many decode
steps' time, so a session decoding while others prefilled kept a small fraction of its plain
decode rate (bench/agent_sessions.py; bench/results/agent-sessions-cpu.md). An agent waits for
its whole turn, the first token and then every other one, so the prefill of one turn must not
stop the decoding of the others.

`StepPace` measures, on the engine's own iterations, what a decode step costs (its rows and
their context as they are now) and what a prefill pass costs: a fixed part for the pass (every
weight read once, every kernel launched once) and a part per token, fitted over the recent
passes. Each iteration with rows decoding earns the prefill `share` decode steps' time; a pass
runs once the credit pays for it, sized to the credit: a decoding stream keeps about
1 / (1 + share) of its rate. A pass smaller than `EFFICIENT` times its fixed part would spend
most of its time on that part, so the credit saves up for a larger one (unless less is left to
prefill). On a CPU the fixed part is small and a pass runs every iteration; on a GPU a pass of
a few tokens costs about what a pass of a thousand does, and a per-token average over small
passes (the pace before this one) shrank the chunks until every iteration paid a whole pass
for a handful of tokens. Alone (nobody decoding) a prompt gets the whole chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why 1.0 (a decoding stream keeps half its rate): measured, docs/scheduling.md.
DEFAULT_SHARE = 1.0
MIN_TOKENS = 8  # the smallest pass worth running where a pass has no fixed part to speak of
EFFICIENT = 4.0  # a pass runs at least this many times its fixed part, where it can
SMOOTHING = 0.2  # weight of the newest iteration in the moving averages and the fit


@dataclass
class StepPace:
    share: float = DEFAULT_SHARE
    min_tokens: int = MIN_TOKENS
    decode_s: float = 0.0  # seconds of a decode step, 0 until measured
    # The fit of a prefill pass's seconds to its tokens, decayed sums of weight, tokens,
    # seconds, tokens squared and tokens x seconds (least squares with forgetting).
    fit: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    credit: float = 0.0  # seconds of prefill the decode steps have paid for and not spent

    def observe(self, seconds: float, decoded: bool, prefilled: int) -> None:
        """One iteration took `seconds`: a decode step if `decoded`, and `prefilled` tokens."""
        if decoded and not prefilled:
            self.decode_step(seconds)
        elif prefilled:
            self.prefill_pass(max(seconds - (self.decode_s if decoded else 0.0), 0.0),
                              prefilled, decoded)

    def decode_step(self, seconds: float) -> None:
        """A decode step of the running rows took `seconds`, with no prefill in it."""
        self.decode_s = _average(self.decode_s, seconds)

    def prefill_pass(self, seconds: float, tokens: int, decoding: bool) -> None:
        """A prefill of `tokens` took `seconds`; `decoding`: it spent the credit that rows
        decoding meanwhile earned."""
        keep = 1 - SMOOTHING if self.fit[0] else 0.0
        self.fit = tuple(keep * old + new for old, new in zip(
            self.fit, (1.0, tokens, seconds, tokens * tokens, tokens * seconds)))
        if decoding:
            self.credit = max(self.credit - seconds, 0.0)

    @property
    def pass_s(self) -> float:
        """Seconds of a prefill pass whatever its tokens (0 until two sizes were seen)."""
        return self._line()[0]

    @property
    def token_s(self) -> float:
        """Seconds a prefilled token adds to its pass (0 until measured)."""
        return self._line()[1]

    def _line(self) -> tuple[float, float]:
        w, n, s, nn, ns = self.fit
        if not w or not n:
            return 0.0, 0.0
        spread = w * nn - n * n
        if spread > 1e-9 * w * nn:  # passes of more than one size: a line through them
            per = (w * ns - n * s) / spread
            fixed = (s - per * n) / w
            if per > 0 and fixed >= 0:
                return fixed, per
        return 0.0, s / n  # one size seen (or a line that says nothing): all per token

    def budget(self, chunk: int, decoding: bool, wanted: int | None = None) -> int:
        """Prompt tokens for this iteration's prefill, at most `chunk` (0: none this time, the
        credit saves up). `wanted`: tokens the waiting prompts have left (None: unknown). Call
        it once an iteration that may prefill: each call earns the decode step's share."""
        fixed, per = self._line()
        if not decoding or not (self.decode_s and per):
            return chunk
        cap = fixed + per * chunk  # never save up for more than one whole chunk
        self.credit = min(self.credit + self.share * self.decode_s, cap)
        # At the cap a whole chunk is paid for (rounding must not leave it a token short).
        fits = chunk if self.credit >= cap else int((self.credit - fixed) / per)
        worth = max(self.min_tokens, int(EFFICIENT * fixed / per))
        need = min(worth, chunk, wanted if wanted is not None else chunk)
        return min(chunk, fits) if fits >= need else 0


def _average(old: float, new: float) -> float:
    return new if not old else (1 - SMOOTHING) * old + SMOOTHING * new
