"""Grammar-constrained decoding with llguidance: one matcher per constrained sequence.

A request's grammar is an llguidance grammar in its JSON TopLevelGrammar form (what
`llguidance.LLMatcher.grammar_from_json_schema` or `grammar_from_lark` returns). `Grammars`
builds the model's llguidance tokenizer once per worker and compiles grammars with it. Then,
for every step of a constrained row:

1. `fill_masks` writes the row's allowed tokens into a bitmask: CPU work that llguidance does
   on its own threads with the GIL released, while the device computes the step's logits;
2. `allowed_tokens` unpacks the bitmask on the device with plain MLX ops (llguidance's own MLX
   helper is a Metal kernel; this runs on any backend) and the sampler masks the row's logits;
3. `GrammarMatcher.advance` feeds the sampled token back and says, as a `Verdict`, whether the
   sequence goes on, ends with that token, or failed.

The matcher of a request resumed after a failover first takes the tokens it had generated.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from omlx_node.load_priority import lower_this_thread

log = logging.getLogger(__name__)

# Errors without the parser's state: verbose ones (llguidance's default) dump the grammar and
# the text generated so far, and an error goes back to the client and into logs.
_TERSE = llguidance.LLParserLimits(verbose_errors=False)


class Verdict(enum.IntEnum):
    """What a sampled token did to its sequence's grammar (an int on the pipeline's wire)."""

    GO = 0  # allowed; the grammar goes on
    LAST = 1  # allowed and completes the grammar: stream it, then the sequence stops
    END = 2  # the grammar's end-of-sequence token: the sequence stops without streaming it
    ERROR = 3  # the matcher failed (its `error` says why): the sequence ends with an error


class GrammarMatcher:
    """The llguidance matcher of one constrained sequence."""

    def __init__(self, matcher: llguidance.LLMatcher | None, eos_tokens: frozenset[int],
                 error: str = ""):
        """`error`: why no usable matcher could be made (then `matcher` may be None)."""
        self._matcher = matcher
        self._eos = eos_tokens
        # Set once here (a grammar that did not compile); later failures are the matcher's own.
        self._error = error or (matcher.get_error() if matcher is not None else "")
        self._verdict: Verdict | None = None  # how it ended

    @property
    def error(self) -> str:
        return self._error or self._matcher.get_error()

    @property
    def active(self) -> bool:
        """Whether it still constrains its row (its mask must be filled before sampling)."""
        return self._verdict is None and not self._error

    def advance(self, token: int) -> Verdict:
        """Takes the token sampled under this matcher's last mask."""
        if self._verdict is None:
            if self._error or not self._matcher.consume_token(token):
                self._verdict = Verdict.ERROR
            elif self._matcher.is_stopped():
                self._verdict = Verdict.END if token in self._eos else Verdict.LAST
            else:
                return Verdict.GO
        # A pipeline row rides along one step after its end; its later tokens are never read.
        return self._verdict


def advance_rows(rows: list[tuple[GrammarMatcher, int]]) -> list[tuple[Verdict, str]]:
    """Each matcher takes its row's sampled token: its verdict, and its error if it failed."""
    out = []
    for matcher, token in rows:
        verdict = matcher.advance(token)
        out.append((verdict, matcher.error if verdict == Verdict.ERROR else ""))
    return out


class Grammars:
    """Compiles grammars for one model folder. Its llguidance tokenizer, built from the
    folder's HF tokenizer (about a second for a large vocabulary), is made once, on first use
    or by `warm`, and shared by every matcher; llguidance's calls are thread-safe."""

    def __init__(self, model_path: Path | str):
        self.model_path = Path(model_path)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._error = ""

    def warm(self, nice: int = 0) -> None:
        """Builds the tokenizer on a thread of its own at `nice` (a worker's load's: beside
        the models that serve), so the first grammar does not wait."""
        def build() -> None:
            lower_this_thread(nice)
            self._ensure()

        threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()

    def wait(self) -> None:
        """Returns once the tokenizer is built (here, if `warm` did not start it) or failed."""
        self._ensure()

    def _ensure(self) -> None:
        with self._lock:
            if self._tokenizer is not None or self._error:
                return
            t0 = time.perf_counter()
            try:
                self._tokenizer = self._build()
            # Whatever fails here (missing files, a slow-only tokenizer) must end the requests
            # that need a grammar, never the worker; the message goes to each of them.
            except Exception as e:
                self._error = (f"grammars are unavailable on this node: its tokenizer in "
                               f"{self.model_path} cannot be used ({type(e).__name__}: {e})")
                log.warning("%s", self._error)
                return
            log.info("grammar tokenizer built in %.2fs", time.perf_counter() - t0)

    def _build(self) -> llguidance.LLTokenizer:
        from transformers import AutoTokenizer

        config = json.loads((self.model_path / "config.json").read_text())
        hf = AutoTokenizer.from_pretrained(self.model_path)
        # The model's end tokens, as mlx-lm reads them (config.json) plus the tokenizer's own.
        eos = config.get("eos_token_id")
        eos_ids = {*(eos if isinstance(eos, list) else [eos]), hf.eos_token_id} - {None}
        # n_vocab: the logits' width, so a row's bitmask covers every logit.
        return llguidance.hf.from_tokenizer(hf, n_vocab=config.get("vocab_size"),
                                            eos_token=sorted(eos_ids) or None)

    def matcher(self, grammar: str, resumed: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for `grammar` that has taken `resumed`. It never raises: one that cannot
        constrain (bad grammar, no tokenizer, resumed tokens the grammar rejects) has `error`."""
        self._ensure()
        if self._tokenizer is None:
            return GrammarMatcher(None, frozenset(), self._error)
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_TERSE)
        if not m.is_error() and resumed and not m.consume_tokens(list(resumed)):
            return GrammarMatcher(m, frozenset(), "the resumed tokens do not follow the grammar: "
                                  + m.get_error())
        return GrammarMatcher(m, frozenset(self._tokenizer.eos_tokens))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_masks(matchers: list[GrammarMatcher], vocab: int) -> np.ndarray:
    """The (len(matchers), ceil(vocab / 32)) int32 bitmask of the tokens each matcher allows
    next (`vocab`: the logits' width, which the tokenizer was built for)."""
    bitmask = allocate_token_bitmask(len(matchers), vocab)
    fill_next_token_bitmask_par(_executor(), [(g._matcher, i) for i, g in enumerate(matchers)],
                                bitmask)
    return bitmask


def allowed_tokens(bitmask: np.ndarray, vocab: int) -> mx.array:
    """The bitmask (bit j of word w: token 32 w + j) as a (batch, vocab) boolean array."""
    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(mx.bool_)
