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

A finished answer is kept too (`keep_answer`): the prompt's text and ids extended by the answer's
text and the ids the model generated for it, with a cut at its end. The next turn's rendered
prompt holds that text followed by a special token (the end of the assistant's turn), so it
reuses the model's own ids for its answer, which the node's prefix cache holds, rather than a
re-tokenization that may spell the same text otherwise (a tokenizer's merges are not the
model's choices) and would lose the cache from the first differing token on. Such ids are by
design not a tokenization of their text: a reuse through them is checked only from its cut on
(the part tokenized alone must end the whole text's tokens).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

MAX_PROMPTS = 64  # conversations whose starts are kept
MAX_TOKENS = 4_000_000  # ...and their tokens in all (int32: 16 MB)
CHECKED_REUSES = 3  # reuses checked against a full tokenization before trusting the scheme


@dataclass(eq=False)
class _Prompt:
    ids: np.ndarray  # int32, the whole prompt's
    keys: list[bytes]  # its cuts' hashes
    exact: bool  # ids are the tokenization of its text (no answer's generated ids in them)
    live: int = 0  # how many of them the index maps to it (a later prompt takes over the rest)


class PrefixTokenizer:
    """`encode(text)` equals `tokenize(text)` (a function of the text alone), but for the
    answers kept (`keep_answer`) that the text starts with, which keep their generated ids;
    `special` maps the tokenizer's special tokens that may serve as cuts to their ids."""

    def __init__(self, tokenize: Callable[[str], list[int]], special: dict[str, int]):
        self._tokenize = tokenize
        self._names = {i: t for t, i in special.items()}
        self._cut_re = (re.compile("|".join(re.escape(t) for t in sorted(special, key=len,
                                                                          reverse=True)))
                        if special else None)
        self._cut_ids = np.array(sorted(self._names), dtype=np.int32)
        self._prompts: OrderedDict[_Prompt, None] = OrderedDict()  # least recently used first
        self._index: dict[bytes, tuple[_Prompt, int]] = {}  # cut hash -> prompt, token index
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
        found = None
        with self._lock:
            for k in range(len(keys) - 1, -1, -1):
                found = self._index.get(keys[k]) if cuts[k] > 0 else None
                if found is not None:
                    self._prompts.move_to_end(found[0])
                    break
        if found is None:
            ids, exact = self._tokenize(text), True
        else:
            prompt, n_tokens = found
            rest = self._tokenize(text[cuts[k]:])
            ids, exact = prompt.ids[:n_tokens].tolist() + rest, prompt.exact
            if self._checks_left > 0 and not self._check(text, ids, None if exact else rest):
                return self._tokenize(text)
        self._keep(text, cuts, keys, _int32(ids), exact)
        return ids

    def keep_answer(self, prompt_text: str, prompt_ids: list[int], text: str,
                    ids: list[int]) -> None:
        """Keeps `prompt_text + text` as spelled by `prompt_ids + ids`, with a cut at its end:
        `ids` are what the model generated after the prompt, `text` what they spell there (no
        special token the text lacks; the caller sees to it)."""
        if self._cut_re is None or not text or not ids:
            return
        whole = prompt_text + text
        cuts = [m.start() for m in self._cut_re.finditer(whole)]
        self._keep(whole, cuts, _chain(whole, [*cuts, len(whole)]),
                   np.concatenate([_int32(prompt_ids), _int32(ids)]), exact=False)

    def _check(self, text: str, ids: list[int], rest: list[int] | None) -> bool:
        """Whether `ids` are what tokenizing `text` whole gives; for ids holding generated ones
        (`rest`: the part tokenized from the cut on), whether that part ends the whole's."""
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
        return False

    def _keep(self, text: str, cuts: list[int], keys: list[bytes], arr: np.ndarray,
              exact: bool) -> None:
        """`keys`: one a cut, and one more for a cut at the text's end (an answer's)."""
        at = np.flatnonzero(np.isin(arr, self._cut_ids))
        if len(at) != len(cuts) or len(arr) > MAX_TOKENS:
            return  # a special token's text that did not become the token: no cuts to trust
        if not all(text.startswith(self._names[int(arr[t])], c) for c, t in zip(cuts, at)):
            return
        if len(keys) > len(cuts):
            cuts, at = [*cuts, len(text)], [*at, len(arr)]
        prompt = _Prompt(arr, [], exact)
        with self._lock:
            if self._cut_re is None:
                return
            self._prompts[prompt] = None
            self._tokens += len(arr)
            for c, key, t in zip(cuts, keys, at):
                if c > 0:  # the newest prompt holding a start serves it: it lives the longest
                    old = self._index.get(key, (None,))[0]
                    self._index[key] = (prompt, int(t))
                    prompt.keys.append(key)
                    prompt.live += 1
                    if old is not None:
                        old.live -= 1
                        if old.live == 0:
                            self._drop(old)
            if prompt.live == 0:
                self._drop(prompt)
            while len(self._prompts) > MAX_PROMPTS or self._tokens > MAX_TOKENS:
                self._drop(next(iter(self._prompts)))

    def _drop(self, prompt: _Prompt) -> None:
        """Lock held."""
        del self._prompts[prompt]
        self._tokens -= len(prompt.ids)
        for key in prompt.keys:
            if self._index.get(key, (None,))[0] is prompt:
                del self._index[key]


def _int32(ids: list[int]) -> np.ndarray:
    # Twice as fast as np.asarray on a list: an answer is kept on the event loop.
    return np.fromiter(ids, dtype=np.int32, count=len(ids))


def _chain(text: str, cuts: list[int]) -> list[bytes]:
    """Per cut, a hash of the text before it (each chained on the one before)."""
    out, h, start = [], b"", 0
    for c in cuts:
        h = hashlib.blake2b(h + text[start:c].encode("utf-8", "surrogatepass"),
                            digest_size=16).digest()
        out.append(h)
        start = c
    return out
