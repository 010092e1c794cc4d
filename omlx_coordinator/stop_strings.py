"""OpenAI `stop` strings over streamed text: emit what cannot start a stop string, hold the rest."""

from __future__ import annotations

from omlx_coordinator.tokenizer import IncrementalDetokenizer


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # what ended the text: Anthropic reports it

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, True
        hold, p = 0, self.pending
        for s in self.stops:
            for k in range(min(len(s) - 1, len(p)), hold, -1):
                # The first character rules out most k without building s[:k].
                if p[-k] == s[0] and p.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
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
