"""The coordinator's only model knowledge: the tokenizer (chat template, EOS ids, detokenising).

It loads with transformers alone, so a coordinator needs no MLX and no weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

# Tokens of the prompt's tail decoded along with the completion, so the first generated token
# keeps its leading space (mlx_lm.server drops it) and prompt + completion is the decoded text.
CONTEXT_TOKENS = 6


def _eos_ids(model_path: Path, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = model_path / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class ChatTokenizer:
    def __init__(self, model_path: Path | str):
        path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_ids = _eos_ids(path, self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(
                "this model has no chat template: use /v1/completions with a plain prompt"
            )
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding here, older versions a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, prompt: list[int]) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte character.

    Decodes a short window of tokens each time (the prefix/read offsets of vLLM and TGI), so the
    cost per token stays constant however long the completion grows.
    """

    def __init__(self, tokenizer: ChatTokenizer, prompt: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]
