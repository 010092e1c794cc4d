"""One model the gateway serves, whether loaded or not: its files, tokenizer, limits and use.

What the API adapters need to turn a request into tokens (the tokenizer, the context, the
vocabulary) never needs the model loaded: a request for an unloaded model is checked and
encoded first, and only then waits for its load. Leases and the last use drive eviction
(omlx_coordinator/models/lifecycle.py): a model with a lease is never evicted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

from omlx_coordinator.models.admission import DEFAULT_MAX_QUEUE, NODE_DEFAULT_BATCH, Admission
from omlx_coordinator.models.model_config import ModelConfig
from omlx_coordinator.models.priority import PriorityGate
from omlx_coordinator.nodes.weight_transfer import WeightSource
from omlx_coordinator.planning.model_layout import (
    ModelLayout,
    read_layout,
    whole_model_layout,
    with_draft,
)
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_shared.model_kinds import CHAT, kind_of, max_input_tokens
from omlx_shared.speculative_modes import draft_path

log = logging.getLogger(__name__)

# What an embedding or reranking model's forward pass takes beside its weights, per unit of
# hidden size: omlx_node/encoders.py's passes of up to 16k padded tokens, float32 hidden states
# and a few intermediates of each.
WORK_BYTES_PER_HIDDEN = 16384 * 4 * 8
# One tokenizer loads at a time, whichever model it is: the first load imports transformers,
# whose lazily built module is not safe to import from two threads at once (a request's load
# on the event loop beside load_tokenizers' thread raised "cannot import name AutoTokenizer").
_TOKENIZER_LOAD = threading.Lock()

# What /v1/models and `status` show of a model.
UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


def _text_setting(config: dict, key: str) -> int:
    """A config value; multimodal configs keep the language model's under text_config."""
    value = config.get(key)
    if value is None:
        value = (config.get("text_config") or {}).get(key)
    return int(value or 0)


class ServedModel:
    def __init__(self, config: ModelConfig, path: Path):
        self.config, self.path, self.name = config, path, config.name
        settings = json.loads((path / "config.json").read_text())
        # chat, embed, rerank or transcribe (omlx_shared/model_kinds.py); a config may say
        self.kind = kind_of(path, config.kind)
        self.max_context = _text_setting(settings, "max_position_embeddings")
        if self.kind.kind != CHAT:  # the longest input its position table takes
            self.max_context = max_input_tokens(settings)
        # Loaded on first use or by load_tokenizer, whichever comes first, not here: see
        # load_tokenizer.
        self._tokenizer: ChatTokenizer | None = None
        self._vocab_size = _text_setting(settings, "vocab_size")
        self.layout: ModelLayout = (
            read_layout(path, model_id=config.name) if self.kind.kind == CHAT else
            whole_model_layout(path, config.name,
                               WORK_BYTES_PER_HIDDEN * _text_setting(settings, "hidden_size")))
        if self.kind.kind == CHAT and (draft := draft_path(config.speculative)):
            try:  # the draft's folder is the head node's; here too with `serve`
                self.layout = with_draft(self.layout, Path(draft))
            except ValueError as e:
                log.warning("model %s: its draft model's memory is not planned for: %s",
                            self.name, e)
        self.state = UNLOADED
        self.pinned = config.pinned
        # Idle seconds before it is unloaded (0: never): the config's, until a request sets it
        # (Ollama's keep_alive, api/ollama.py).
        self.ttl_seconds = config.ttl_seconds
        self.leases = 0  # requests admitted and not yet finished
        self.admission = Admission(config.max_queue or DEFAULT_MAX_QUEUE,  # the queue bound
                                   slots=config.slots or NODE_DEFAULT_BATCH)
        self.gate = PriorityGate(config.slots or NODE_DEFAULT_BATCH, config.batch_share)
        self.last_used = time.monotonic()
        self.error = ""  # why its last load failed ("" when it did not)
        self.load_seconds = 0.0  # of its last load, eviction included
        self.loaded_at = 0.0  # when (time.time()) its last load ended
        self.loads = 0
        self.unloads: dict[str, int] = {}  # by reason: evicted, ttl, pressure, request
        self._released = asyncio.Event()  # set whenever a lease ends
        self._weight_source: WeightSource | None = None  # indexed when a remote node needs it
        self._draft_source: WeightSource | None = None  # its draft model's, likewise

    @property
    def tokenizer(self) -> ChatTokenizer:
        """Its tokenizer, loaded now if load_tokenizer has not yet (or is loading it: then this
        waits for that load, on whatever thread asks)."""
        return self.load_tokenizer()

    def load_tokenizer(self) -> ChatTokenizer:
        """Loads its tokenizer once. The gateway calls it on a thread once a model serves
        (ModelManager.load_tokenizers): a coordinator restarted under a load spent most of its
        time to its first answer importing transformers and loading tokenizers, which nothing
        needs before a request does, while its nodes could not register
        (bench/results/restart-cpu.md)."""
        if self._tokenizer is not None:  # every request asks: no lock once loaded
            return self._tokenizer
        with _TOKENIZER_LOAD:
            if self._tokenizer is None:
                self._tokenizer = ChatTokenizer(self.path, self.max_context)
            return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Its vocabulary's size: the config's, else its tokenizer's."""
        return self._vocab_size or len(self.tokenizer.tokenizer)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.config.aliases)

    def acquire(self) -> None:
        self.leases += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.leases -= 1
        self.last_used = time.monotonic()
        self._released.set()

    async def lease_ended(self, timeout: float) -> None:
        """Returns when some lease of this model ends (or after `timeout`)."""
        self._released.clear()
        try:
            await asyncio.wait_for(self._released.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def weight_source(self) -> WeightSource:
        """The index of its files that remote nodes receive their layers from."""
        if self._weight_source is None:
            self._weight_source = await asyncio.to_thread(WeightSource, self.path, self.name,
                                                          self.kind.kind != CHAT)
        return self._weight_source

    async def draft_source(self) -> WeightSource | None:
        """The index of its draft model's files (`speculative = "draft=PATH"`), which a remote
        head node receives as it receives its layers; None without a draft model, or where
        this machine lacks its folder (then PATH is the head node's own)."""
        path = draft_path(self.config.speculative) if self.kind.kind == CHAT else ""
        if not path or not (Path(path) / "config.json").is_file():
            return None
        if self._draft_source is None:
            self._draft_source = await asyncio.to_thread(WeightSource, Path(path),
                                                         Path(path).name)
        return self._draft_source

    def idle_seconds(self) -> float:
        return time.monotonic() - self.last_used
