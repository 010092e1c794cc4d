"""OpenAI `stop` strings over streamed text: emit what cannot start a stop string, hold the rest."""

from __future__ import annotations

from omlx_coordinator.text.tokenizer import IncrementalDetokenizer


def _failure(s: str) -> list[int]:
    """KMP's failure function: f[i] is the longest proper prefix of s[:i + 1] that is also its
    suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Each stop string's KMP state (how much of its start the text ends with) advances by the
    new characters only: what to hold back costs O(new text) per token, not O(held text) per
    stop string (a long stop string over text that nearly matches it took milliseconds a token,
    on the event loop every stream shares)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)
        self.pending = ""
        self.matched: str | None = None  # what ended the text: Anthropic reports it

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        hit = False
        for j, (s, f) in enumerate(zip(self.stops, self._fail)):
            k = self._state[j]
            for c in delta:
                while k and s[k] != c:
                    k = f[k - 1]
                if s[k] == c:
                    k += 1
                    if k == len(s):
                        hit, k = True, f[k - 1]
            self._state[j] = k
        if hit:  # the earliest start among the stop strings found, as str.find says
            at, self.matched = min((i, s) for s in self.stops
                                   if (i := self.pending.find(s)) >= 0)
            out, self.pending = self.pending[:at], ""
            return out, True
        # What could still become a stop string: the longest start of one the text ends with.
        cut = len(self.pending) - max(self._state)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def feed_tokens(self, detok: IncrementalDetokenizer, tokens: list[int], last: bool
                    ) -> tuple[str, bool, int]:
        """`feed` for a chunk of tokens: the text safe to emit, whether a stop string was
        reached, and how many of `tokens` it took to reach it (all of them if none was). A
        chunk holds several steps' tokens where a node sends a stream interval's together;
        the tokens past the one that completes a stop string were generated, not answered,
        and the usage does not count them. `last`: the stream's last chunk (what the
        detokenizer holds back is flushed)."""
        # Token by token only where a stop string may cut the chunk.
        groups = [[t] for t in tokens] if self.stops and tokens else [tokens]
        out, taken = "", 0
        for k, group in enumerate(groups, 1):
            text = (detok.add_many(group) if group else "") + (
                detok.flush() if last and k == len(groups) else "")
            piece, hit = self.feed(text)
            out, taken = out + piece, taken + len(group)
            if hit:
                return out, True, taken
        return out, False, taken

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
