"""Tokenizing a rendered prompt without tokenizing again the start it shares with an earlier one.

Agents resend their whole conversation every turn, and tokenizing it was the largest cost of a
cache-hit turn outside the engine (a Claude-Code-sized request, every turn). A rendered chat is
made of turns that each start with a special token (`<|im_start|>`, `<|start_header_id|>`...), and
a tokenizer splits its added special tokens out of the text before anything else runs: what comes
before one tokenizes the same whatever follows it. So the tokens of an earlier prompt up to the
last special token both prompts share at the same place are reused, and only the rest is tokenized.

Prompts are indexed at those cuts by a hash chain of the text before each (like the KV cache's
block hashes), so finding the longest reusable start costs one pass over the text. Only special
tokens that match exactly are cuts (one that strips the whitespace before it, or matches only as
a whole word, depends on its neighbours), and a prompt is indexed only where its token ids put
each of those tokens exactly where the text has it. The first reuses are checked against a full
tokenization; a mismatch turns reuse off for the tokenizer, with a warning.

A finished answer is kept too (`keep_answer`): the prompt's ids and the ids the model generated
for its answer, found through the hash of the prompt's text up to its last cut (the start of the
assistant's turn). The next turn's rendered prompt holds that text, then the answer's text as
the template writes it back, so it reuses the prompt's ids and the model's own ids for as much
of the answer as it writes back as generated, which the node's prefix cache holds, rather than
a re-tokenization that may spell the same text otherwise (a tokenizer's merges are not the
model's choices) and would lose the cache from the first differing token on. Where the
template writes the answer otherwise (text before a tool call keeps its newline, and Qwen's
template writes one more), the generated ids are reused up to the last token whose text the
rendered prompt still holds there, and the rest is tokenized from that character: ids through
a kept answer are by design not a tokenization of their text, only a spelling of it, so that
part is checked to spell its text (every time: it costs its own tokens' bytes), and a reuse
through such ids is checked against a whole tokenization only from the cut after the answer
on (the part tokenized alone must end the whole text's tokens).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MAX_PROMPTS = 64  # conversations whose starts are kept
MAX_TOKENS = 4_000_000  # ...and their tokens in all (int32: 16 MB)
MAX_ANSWERS = 8  # answers kept to one prompt (n choices, retries): the newest
CHECKED_REUSES = 3  # reuses checked against a full tokenization before trusting the scheme


@dataclass(eq=False)
class _Answer:
    """What the model generated after a prompt, found by the prompt's last cut."""
    key: bytes  # that cut's hash
    tail: str  # the prompt's text from that cut on (the assistant turn's header)
    text: str  # the answer's
    # int32 (2, n), increasing: per token end on a character boundary, the answer's characters
    # before it and the entry's ids (the prompt's included) that spell them.
    ends: np.ndarray


@dataclass(eq=False)
class _Prompt:
    ids: np.ndarray  # int32, the whole prompt's (and its answer's)
    keys: list[bytes]  # its cuts' hashes
    exact: bool  # ids are the tokenization of its text (no answer's generated ids in them)
    answer: _Answer | None = None  # an answer's entry, also in the answers kept at its key
    live: int = 0  # how many places of the index hold it (a later prompt takes over the rest)

    @property
    def size(self) -> int:
        """The int32s it holds, which MAX_TOKENS bounds."""
        return len(self.ids) + (self.answer.ends.size if self.answer is not None else 0)


class PrefixTokenizer:
    """`encode(text)` equals `tokenize(text)` (a function of the text alone), but for the
    answers kept (`keep_answer`) that the text holds, which keep their generated ids; `special`
    maps the tokenizer's special tokens that may serve as cuts to their ids; `token_bytes`
    spells a token (without it, an answer is reused only whole and where a cut follows)."""

    def __init__(self, tokenize: Callable[[str], list[int]], special: dict[str, int],
                 token_bytes: Callable[[int], bytes] | None = None):
        self._tokenize = tokenize
        self._token_bytes = token_bytes
        self._mid_text = token_bytes is not None  # an answer's ids may end before a cut
        self._names = {i: t for t, i in special.items()}
        self._cut_re = (re.compile("|".join(re.escape(t) for t in sorted(special, key=len,
                                                                          reverse=True)))
                        if special else None)
        self._cut_ids = np.array(sorted(self._names), dtype=np.int32)
        self._prompts: OrderedDict[_Prompt, None] = OrderedDict()  # least recently used first
        self._index: dict[bytes, tuple[_Prompt, int]] = {}  # cut hash -> prompt, token index
        self._answers: dict[bytes, list[_Prompt]] = {}  # a prompt's last cut -> its answers
        self._tokens = 0
        self._checks_left = CHECKED_REUSES
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._cut_re is not None

    def encode(self, text: str) -> list[int]:
        if self._cut_re is None:
            return self._tokenize(text)
        cuts = [m.start() for m in self._cut_re.finditer(text)]
        keys = _chain(text, cuts)
        found, k, answers = None, 0, []
        with self._lock:
            for k in range(len(keys) - 1, -1, -1):
                found = self._index.get(keys[k]) if cuts[k] > 0 else None
                if found is not None:
                    self._prompts.move_to_end(found[0])
                    break
            # An answer kept after a cut before the one found reaches no further than it.
            for j in range(len(keys) - 1, k - 1 if found else -1, -1):
                answers += [(j, a) for a in self._answers.get(keys[j], ())]
        through = self._through_answer(text, cuts, answers)
        done = None  # the answer entry this prompt's entry holds up to a cut, once kept
        if through is not None:
            entry, at, n_tokens = through
            ids = self._after_answer(text, cuts, at, entry.ids[:n_tokens].tolist())
            if ids is None:
                return self.encode(text)  # reuse stopped, or mid-text reuse did: bounded
            exact, done = False, entry if at <= cuts[-1] else None
        elif found is None:
            ids, exact = self._tokenize(text), True
        else:
            prompt, n_tokens = found
            rest = self._tokenize(text[cuts[k]:])
            ids, exact = prompt.ids[:n_tokens].tolist() + rest, prompt.exact
            if self._checks_left > 0 and not self._check(text, ids, None if exact else rest):
                return self._tokenize(text)
        self._keep(text, cuts, keys, _int32(ids), exact, done=done)
        return ids

    def _through_answer(self, text: str, cuts: list[int], answers: list[tuple[int, _Prompt]]
                        ) -> tuple[_Prompt, int, int] | None:
        """The kept answer `text` holds the most of after its prompt, by cut, last first:
        (its entry, where in `text` its reused ids end, how many of the entry's ids)."""
        best = None
        for j, entry in answers:
            if best is not None and j != best[3]:
                break  # an answer after an earlier cut ends before this one's starts
            answer = entry.answer
            start = cuts[j] + len(answer.tail)
            limit = cuts[j + 1] if j + 1 < len(cuts) else len(text)  # ids spell no cut
            if limit < start or not text.startswith(answer.tail, cuts[j]):
                continue
            same = _shared_start(answer.text, text, start, min(len(answer.text), limit - start))
            i = int(np.searchsorted(answer.ends[0], same, side="right")) - 1
            if i < 0 or answer.ends[0, i] == 0:
                continue
            at = start + int(answer.ends[0, i])
            if (at == limit or self._mid_text) and (best is None or at > best[1]):
                best = (entry, at, int(answer.ends[1, i]), j)
        if best is None:
            return None
        with self._lock:
            if best[0] in self._prompts:
                self._prompts.move_to_end(best[0])
        return best[:3]

    def _after_answer(self, text: str, cuts: list[int], at: int, head: list[int]
                      ) -> list[int] | None:
        """`head` (ids through a kept answer, spelling `text[:at]`) and `text[at:]` tokenized
        alone; None where that part does not spell its text (which stops reuse in mid-text)
        or a check stopped reuse."""
        rest = self._tokenize(text[at:])
        split = 0  # from where `rest` must be the whole text's last tokens
        n = bisect_left(cuts, at)
        if at < len(text) and (n == len(cuts) or cuts[n] != at):  # spelled up to the next cut
            cut_at = np.flatnonzero(np.isin(_int32(rest), self._cut_ids))
            split = int(cut_at[0]) if len(cut_at) else len(rest)
            end = cuts[n] if n < len(cuts) else len(text)
            if b"".join(map(self._token_bytes, rest[:split])) != _utf8(text[at:end]):
                with self._lock:
                    self._mid_text = False
                log.warning("tokenizing a prompt from inside a re-sent answer gave tokens that "
                            "spell other text: answers are reused only up to a special token "
                            "from now on")
                return None
        ids = head + rest
        if self._checks_left > 0 and split < len(rest) and not self._check(text, ids,
                                                                            rest[split:]):
            return None
        return ids

    def keep_answer(self, prompt_text: str, prompt_ids: list[int], text: str,
                    ids: list[int]) -> None:
        """Keeps `ids`, generated after `prompt_ids` (which spell `prompt_text`), as what
        spells `text` there (no special token the text lacks; the caller sees to it)."""
        if self._cut_re is None or not text or not ids or self._cut_re.search(text):
            return  # (a special token's text spelled by other ids is not that token)
        cuts = [m.start() for m in self._cut_re.finditer(prompt_text)]
        ends = self._token_ends(text, ids)
        if not cuts or ends is None:
            return
        ends[1] += len(prompt_ids)
        keys = _chain(prompt_text, cuts)
        answer = _Answer(keys[-1], prompt_text[cuts[-1]:], text, ends)
        self._keep(prompt_text, cuts, keys,
                   np.concatenate([_int32(prompt_ids), _int32(ids)]), False, answer)

    def _token_ends(self, text: str, ids: list[int]) -> np.ndarray | None:
        """`_Answer.ends` (the ids counted from the answer's first); None where `ids` do not
        spell `text` (a decoder that cleans up spaces, a tokenizer whose pieces it cannot
        spell)."""
        if self._token_bytes is None:
            return np.array([[len(text)], [len(ids)]], dtype=np.int32)
        pieces = [self._token_bytes(i) for i in ids]
        raw = _utf8(text)
        if b"".join(pieces) != raw:
            return None
        first = np.append((np.frombuffer(raw, np.uint8) & 0xC0) != 0x80, True)  # of a char
        chars = np.concatenate([[0], np.cumsum(first[:-1])])  # characters before each byte
        at = np.cumsum([len(p) for p in pieces])  # each token's end, in bytes
        whole = first[at]
        return np.stack([chars[at[whole]], np.flatnonzero(whole) + 1]).astype(np.int32)

    def _check(self, text: str, ids: list[int], rest: list[int] | None) -> bool:
        """Whether `ids` are what tokenizing `text` whole gives; for ids holding generated ones
        (`rest`: the part tokenized from a cut on), whether that part ends the whole's."""
        full = self._tokenize(text)
        with self._lock:
            if full == ids if rest is None else (0 < len(rest) <= len(full)
                                                 and full[-len(rest):] == rest):
                self._checks_left -= 1
                return True
            log.warning("tokenizing a prompt's new part alone gave other tokens than tokenizing "
                        "it whole: prompts are tokenized whole from now on")
            self._cut_re = None
            self._prompts.clear()
            self._index.clear()
            self._answers.clear()
        return False

    def _keep(self, text: str, cuts: list[int], keys: list[bytes], arr: np.ndarray,
              exact: bool, answer: _Answer | None = None, done: _Prompt | None = None
              ) -> None:
        """`keys`: one a cut. An answer's entry is also kept by its prompt's last cut; `done`,
        an answer entry whose ids this prompt holds up to a cut after them, is no more needed."""
        at = np.flatnonzero(np.isin(arr, self._cut_ids))
        if len(at) != len(cuts) or len(arr) > MAX_TOKENS:
            return  # a special token's text that did not become the token: no cuts to trust
        if not all(text.startswith(self._names[int(arr[t])], c) for c, t in zip(cuts, at)):
            return
        prompt = _Prompt(arr, [], exact, answer)
        with self._lock:
            if self._cut_re is None:
                return
            self._prompts[prompt] = None
            self._tokens += prompt.size
            for c, key, t in zip(cuts, keys, at):
                if c > 0:  # the newest prompt holding a start serves it: it lives the longest
                    old = self._index.get(key, (None,))[0]
                    self._index[key] = (prompt, int(t))
                    prompt.keys.append(key)
                    prompt.live += 1
                    if old is not None:
                        self._release(old)
            if answer is not None:
                kept = self._answers.setdefault(answer.key, [])
                kept.append(prompt)
                prompt.live += 1
                if len(kept) > MAX_ANSWERS:
                    self._drop(kept[0])
            if done is not None and done in self._prompts:
                self._drop(done)
            if prompt.live == 0:
                self._drop(prompt)
            while len(self._prompts) > MAX_PROMPTS or self._tokens > MAX_TOKENS:
                self._drop(next(iter(self._prompts)))

    def _release(self, prompt: _Prompt) -> None:
        """Lock held: one place of the index holds `prompt` no more."""
        prompt.live -= 1
        if prompt.live == 0:
            self._drop(prompt)

    def _drop(self, prompt: _Prompt) -> None:
        """Lock held."""
        del self._prompts[prompt]
        self._tokens -= prompt.size
        for key in prompt.keys:
            if self._index.get(key, (None,))[0] is prompt:
                del self._index[key]
        if prompt.answer is not None:
            kept = self._answers.get(prompt.answer.key, [])
            if prompt in kept:
                kept.remove(prompt)
            if not kept:
                self._answers.pop(prompt.answer.key, None)


def _shared_start(a: str, b: str, start: int, n: int) -> int:
    """How many of `a`'s first `n` characters `b` holds from `start` on: a binary search of
    C-speed compares over O(n) characters in all (an answer may be long)."""
    lo, hi = 0, n + 1  # a[:lo] is there, a[:hi] is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], start + lo):
            lo = mid
        else:
            hi = mid
    return lo


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _int32(ids: list[int]) -> np.ndarray:
    # Twice as fast as np.asarray on a list: an answer is kept on the event loop.
    return np.fromiter(ids, dtype=np.int32, count=len(ids))


def _chain(text: str, cuts: list[int]) -> list[bytes]:
    """Per cut, a hash of the text before it (each chained on the one before)."""
    out, h, start = [], b"", 0
    for c in cuts:
        h = hashlib.blake2b(h + _utf8(text[start:c]), digest_size=16).digest()
        out.append(h)
        start = c
    return out
