"""A draft model: a small model of the target's tokenizer that drafts each row's next tokens
(`--speculative draft=PATH`), loaded in the worker that runs the whole target model.

Each drafting row has its own `DraftProposer`, which keeps the row's tokens in the draft
model's own KV cache (a one-row cache of plain KVCaches). A step's draft is greedy: the draft
model's argmax, fed back k-1 times. Its cache then holds the row's tokens and all but the last
drafted one; at the next step the row's tokens say how many of those stood, and the cache is
trimmed back to them (the rejected ones never stay), then fed what is new (the target's own
token), as mlx-lm's speculative_generate_step keeps its draft cache in step. A prompt is
computed alongside the target's prefill chunks (`feed`), so the first draft waits for none of
it. A deterministic draft is what the target's rejection sampling
(omlx_node.speculation.verify_sampled) needs to keep sampled rows exactly on the target's
distribution; greedy rows keep exactly the target's tokens whatever the draft says.

The draft model must tokenize as the target does: a draft token is a target token id. A folder
whose tokenizer maps any token to another id, or has another vocabulary, is refused with the
first difference named.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from weakref import WeakKeyDictionary

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx_node.speculation import Proposer
from omlx_node.stage import StageError, StageRunner

log = logging.getLogger(__name__)

# Prompt tokens the draft model takes per forward pass when a row first drafts (its whole
# prompt): bounds the pass's activations, as a prefill chunk does.
DRAFT_PREFILL_CHUNK = 512


class DraftError(ValueError):
    """A draft model this target cannot use; the message says why and what to do."""


# Each target's draft model, loaded once (`draft_for`).
_loaded: WeakKeyDictionary[StageRunner, DraftModel] = WeakKeyDictionary()


def draft_for(path: Path | str, target: StageRunner) -> DraftModel:
    """The draft model in `path` for `target`, loaded once a target: a worker loads it with its
    target, on its loading thread at the load's priority (omlx_node.worker.finish_load), and
    its engine takes the same one, so that reading its weights and tokenizer does not run at
    the serving thread's priority beside a neighbour's decode."""
    draft = _loaded.get(target)
    if draft is None or draft.path != Path(path):
        draft = _loaded[target] = DraftModel(path, target)
    return draft


def _vocabulary(path: Path) -> tuple[dict[str, int], object]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # missing or unreadable files: transformers raises many kinds
        raise DraftError(f"the tokenizer in {path} cannot be read ({type(e).__name__}: {e})"
                         ) from e
    return tok.get_vocab(), tok.eos_token_id


def check_same_tokenizer(draft: Path, target: Path) -> None:
    """Raises DraftError unless the two folders' tokenizers map the same tokens to the same
    ids (and end on the same token)."""
    (dv, deos), (tv, teos) = _vocabulary(draft), _vocabulary(target)
    if dv != tv:
        differ = sorted(set(dv.items()) ^ set(tv.items()), key=lambda kv: kv[1])
        token, _ = differ[0]
        raise DraftError(
            f"draft model {draft} has another tokenizer than the model it drafts for "
            f"({len(dv)} tokens against {len(tv)}; {len(differ)} (token, id) pairs differ, "
            f"e.g. {token!r}: {dv.get(token)} against {tv.get(token)}): use a draft model of "
            f"the same family and tokenizer (e.g. Qwen3-0.6B for Qwen3-32B)")
    if deos != teos:
        raise DraftError(f"draft model {draft} ends on token {deos}, the model it drafts for on "
                         f"{teos}: use a draft model of the same tokenizer")


class DraftModel:
    """The draft model of one engine; `proposer` makes each row's."""

    def __init__(self, path: Path | str, target: StageRunner):
        """`target`: the whole model it drafts for (its folder's tokenizer must be the same)."""
        self.path = path = Path(path)
        if not (path / "config.json").is_file():
            raise DraftError(f"draft model folder {path} has no config.json: give draft=PATH "
                             f"the folder of an mlx-lm model on this node")
        check_same_tokenizer(path, target.path)
        try:
            self.stage = StageRunner(path)
        except StageError as e:
            raise DraftError(f"the draft model cannot be loaded: {e}") from e
        kinds = {type(c).__name__ for c in self.stage.make_cache()}
        if kinds != {KVCache.__name__}:
            raise DraftError(f"draft model {path} keeps {', '.join(sorted(kinds))} layer "
                             f"caches; a draft needs plain KV caches, which its rejected "
                             f"tokens can be trimmed from: use a full-attention model")
        # A draft token must be one the target can take (a padded head may say more ids).
        self.vocab = target.embed_tokens.weight.shape[0]
        log.info("draft model %s loaded (%d MiB)", path, self.stage.nbytes() >> 20)

    def nbytes(self) -> int:
        return self.stage.nbytes()

    def proposer(self) -> DraftProposer:
        return DraftProposer(self)


class DraftProposer(Proposer):
    """One row's drafts from the draft model, with the row's tokens in its own KV cache."""

    source = "draft"

    def __init__(self, model: DraftModel):
        self.model = model
        self.cache = model.stage.make_cache()
        self.held: list[int] = []  # the tokens the cache holds, in order
        self.known = 0  # of them, how many are the row's own (the rest were drafted)

    def feed(self, tokens: Sequence[int]) -> None:
        self._compute(tokens[len(self.held):])
        self.held, self.known = list(tokens), len(tokens)

    def _compute(self, tokens: Sequence[int]) -> None:
        """Runs `tokens` into the cache (what follows what it holds), a chunk a pass."""
        for start in range(0, len(tokens), DRAFT_PREFILL_CHUNK):
            piece = list(tokens[start:start + DRAFT_PREFILL_CHUNK])
            self.model.stage(mx.array([piece]), self.cache, last_only=True)
            mx.eval([c.state for c in self.cache])

    def propose(self, tokens: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        # The drafted tokens that stood are the row's now: keep them, trim what did not.
        limit = min(len(self.held), len(tokens) - 1)  # the last token is fed: its logits
        keep = min(self.known, limit)
        while keep < limit and self.held[keep] == tokens[keep]:
            keep += 1
        if len(self.held) > keep:
            for c in self.cache:
                c.trim(len(self.held) - keep)
        new = list(tokens[keep:])
        self._compute(new[:-1])
        draft: list[int] = []
        y, fed = new[-1], 0
        for _ in range(k):
            logits = self.model.stage(mx.array([[y]]), self.cache, last_only=True)
            fed += 1
            y = mx.argmax(logits[0, -1]).item()
            if y >= self.model.vocab:
                break
            draft.append(y)
        # Fed: the row's last token, then each draft token but the one the loop ended on.
        self.held, self.known = list(tokens) + draft[:fed - 1], len(tokens)
        return draft
