"""The coordinator's only model knowledge: the tokenizer (chat template, EOS ids, detokenising).

It loads with transformers alone, so a coordinator needs no MLX and no weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from omlx_coordinator.errors import APIError
from omlx_coordinator.text.prefix_tokens import PrefixTokenizer
from omlx_coordinator.text.tool_calls import ToolCallFormat

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


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character each byte is written as in a
    vocabulary piece -> the byte (printable bytes stand for themselves, the rest are shifted
    past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


# More characters than this many a token of the context cannot fit: a prompt past it is refused
# before it is tokenized (a body of tens of MB would hold the threads every request
# tokenizes on for a long time).
MAX_CHARS_PER_TOKEN = 32


class ChatPrompt(list):
    """A rendered chat's token ids (a list of them, as any prompt) that also holds the text they
    spell: an answer to it is kept against that text for the next turn (`keep_answer`). A copy
    or an edit of the ids (slicing, `+`, `list()`) is a plain list and holds no text."""

    def __init__(self, ids: list[int], text: str):
        super().__init__(ids)
        self.text = text


class ChatTokenizer:
    def __init__(self, model_path: Path | str, max_context: int | None = None):
        # Imported here, not with the module: transformers costs a second or more of CPU to
        # import, which a restarted coordinator must not spend before it listens (its nodes
        # register over HTTP) but while it waits for them (ServedModel.load_tokenizer).
        from transformers import AutoTokenizer

        path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_ids = _eos_ids(path, self.tokenizer)
        self.max_context = max_context
        self._token_strings: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @cached_property
    def tool_call_format(self) -> ToolCallFormat | None:
        """The tool-call markup of this model's family (tool_calls.py), None without one."""
        return ToolCallFormat.infer(self.tokenizer)

    @cached_property
    def _skipped_ids(self) -> frozenset[int] | None:
        """The special tokens decoding drops, when that set must spare the tool-call markers
        (Mistral's [TOOL_CALLS], Kimi's sections... are special tokens); None: the usual set."""
        fmt = self.tool_call_format
        special = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()
                   if t.special}
        kept = {i for i, c in special.items() if fmt and (c in fmt.start or c in fmt.end)}
        return frozenset(set(special) - kept) if kept else None

    @cached_property
    def cut_tokens(self) -> dict[str, int]:
        """The special tokens a rendered chat may be cut before (prefix_tokens.py): those that
        match exactly (one that strips whitespace before it depends on its neighbours), but not
        the unknown token, which stands for text as well."""
        unk = self.tokenizer.unk_token_id
        return {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items()
                if t.special and not t.lstrip and not t.single_word and i != unk}

    @cached_property
    def prefix_tokenizer(self) -> PrefixTokenizer:
        """Tokenizes rendered chats, reusing the tokens of an earlier one's start (agents resend
        their conversation every turn)."""
        return PrefixTokenizer(self._encode_rendered, self.cut_tokens, self.token_bytes)

    def _encode_rendered(self, text: str) -> list[int]:
        """What apply_chat_template(tokenize=True) does with the text it renders."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> ChatPrompt:
        if not self.has_chat_template:
            raise ValueError(
                "this model has no chat template: use /v1/completions with a plain prompt"
            )
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        self._check_length(text, "messages")
        return ChatPrompt(self.prefix_tokenizer.encode(text), text)

    def keep_answer(self, prompt: ChatPrompt, text: str, ids: list[int]) -> None:
        """Remembers `ids`, generated after `prompt`, as the tokens of `text` (what they were
        detokenized to) for the next turn, which re-sends the answer rendered after the prompt:
        that turn is given the model's own ids rather than a re-tokenization of its text
        (prefix_tokens.py says why). Not where the text cannot be the ids' spelling: a special
        token decoding drops, or a character cut off at the end (U+FFFD)."""
        if "\ufffd" in text or not self._dropped_ids.isdisjoint(ids):
            return
        self.prefix_tokenizer.keep_answer(prompt.text, prompt, text, ids)

    @cached_property
    def _dropped_ids(self) -> frozenset[int]:
        """The ids `decode` leaves out of the text."""
        skipped = self._skipped_ids
        if skipped is not None:
            return skipped
        return frozenset(i for i, t in self.tokenizer.added_tokens_decoder.items()
                         if t.special) | frozenset(self.tokenizer.all_special_ids)

    def encode_text(self, text: str, param: str) -> list[int]:
        """The tokens of `text` as a rendered chat holds it (no special tokens added): what
        the model writes when it writes `text`. `param` names it in a 400 when too long."""
        if self.max_context and len(text) > self.max_context * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"{param} is too long: {len(text)} characters, more than the "
                                f"model's context of {self.max_context} tokens can hold",
                           param=param)
        return self._encode_rendered(text)

    def encode(self, text: str) -> list[int]:
        self._check_length(text, "prompt")
        return list(self.tokenizer(text)["input_ids"])

    def _check_length(self, text: str, param: str) -> None:
        if self.max_context and len(text) > self.max_context * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"prompt is too long: {len(text)} characters, more than the "
                                f"model's context of {self.max_context} tokens can hold; "
                                "shorten the prompt", param=param,
                           code="context_length_exceeded")

    def decode(self, ids: list[int]) -> str:
        skipped = self._skipped_ids
        if skipped is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in skipped],
                                     skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        """A token's own text (OpenAI's logprobs `token`): its vocabulary entry decoded (a
        piece of a multi-byte character becomes U+FFFD). Cached: logprobs ask for up to 21
        tokens per generated one."""
        text = self._token_strings.get(token_id)
        if text is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([piece]) if piece is not None else ""
            self._token_strings[token_id] = text
        return text

    @cached_property
    def _piece_bytes(self) -> Callable[[str], bytes] | None:
        """How a vocabulary piece spells its bytes, from the tokenizer's decoder: byte-level
        BPE (GPT-2, Llama 3, Qwen), SentencePiece with byte fallback (Llama 2, Mistral); None
        for any other."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        try:
            decoder = json.loads(backend.decoder.__getstate__())
        except (AttributeError, TypeError, ValueError):
            return None
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
        if "ByteLevel" in kinds:
            table = _byte_level_table()
            return lambda piece: bytes(table[c] for c in piece)
        if "ByteFallback" in kinds:
            return lambda piece: (bytes([int(m[1], 16)]) if (m := _BYTE_PIECE.fullmatch(piece))
                                  else piece.replace("\u2581", " ").encode())
        return None

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (OpenAI's logprobs `bytes`): a piece of a multi-byte character
        is its bytes, which with its neighbours' make the character. Cached, as token_string."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self._spell(token_id)
        return raw

    def _spell(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        spell = self._piece_bytes
        if piece is not None and spell is not None and \
                token_id not in self.tokenizer.added_tokens_decoder:
            try:
                return spell(piece)
            except KeyError:  # a piece outside the byte alphabet
                pass
        return self.token_string(token_id).encode()

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
        return self.add_many([token])

    def add_many(self, tokens: list[int]) -> str:
        """The text `tokens` complete: one window decode for a whole chunk of them, which is
        what keeps a busy stream cheap (a decode call costs the same for one token or ten)."""
        self.ids += tokens
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
