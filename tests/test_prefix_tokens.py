"""A chat prompt tokenized reusing an earlier prompt's start (omlx_coordinator/text/prefix_tokens.py)
gives exactly the token ids of tokenizing it whole, on real tokenizers of the kinds models ship:
byte-level BPE (Qwen's markup and tool template, the default SmolLM2), and SentencePiece-style
ones whose first piece of text is treated apart (Metaspace `first`, Llama 2's Prepend normalizer).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from omlx_coordinator.text import prefix_tokens
from omlx_coordinator.text.prefix_tokens import PrefixTokenizer
from omlx_coordinator.text.tokenizer import ChatTokenizer
from tests.tiny_models import CHATML, CORPUS, SPECIAL_TOKENS, qwen_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "Read", "description": "Reads a file.",
    "parameters": {"type": "object", "required": ["path"],
                   "properties": {"path": {"type": "string"}}}}}]


def sentencepiece_like(dest: Path, kind: str) -> Path:
    """A Unigram tokenizer whose spaces are "▁": Metaspace with prepend_scheme `first`, or
    Llama 2's normalizer (Prepend + Replace) with no pre-tokenizer."""
    tok = Tokenizer(models.Unigram())
    if kind == "metaspace-first":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS * 20, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, unk_token="<|endoftext|>",
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module", params=["qwen", "smollm2", "metaspace-first", "llama2-normalizer"])
def tok(request, tmp_path_factory) -> ChatTokenizer:
    if request.param == "smollm2":
        return ChatTokenizer(request.getfixturevalue("default_model_path"))
    dest = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen":
        return ChatTokenizer(qwen_tokenizer(dest))
    return ChatTokenizer(sentencepiece_like(dest, request.param))


def whole(tok: ChatTokenizer, messages: list[dict], tools=None) -> list[int]:
    ids = tok.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                            tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class Counting:
    """The tokenizer's own function, counting the characters it is given."""

    def __init__(self, tok: ChatTokenizer):
        self.f, self.chars = tok._encode_rendered, 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.f(text)


TURNS = [
    ("user", "Where is the main function defined?  "),
    ("assistant", " It is in main.py, at line 12.\n\n"),
    ("user", "Now explain what it does: café, 東京 🙂, <|im_start|> as text, tabs\t\t"),
    ("assistant", "It prints 'hello' and exits with status 0."),
    ("user", "  Leading spaces, then a trailing newline\n"),
]


def test_every_turn_gives_the_whole_prompts_tokens_and_reuses_the_last(tok, monkeypatch):
    monkeypatch.setattr(prefix_tokens, "CHECKED_REUSES", 0)  # what is reused is what is seen
    system = [{"role": "system", "content": "You are a coding agent. " * 50}]
    counting = Counting(tok)
    pt = PrefixTokenizer(counting, tok.cut_tokens)
    messages = list(system)
    for role, content in TURNS:
        messages.append({"role": role, "content": content})
        if role != "user":
            continue
        text = tok.tokenizer.apply_chat_template(messages, tools=TOOLS,
                                                 add_generation_prompt=True, tokenize=False)
        before = counting.chars
        ids = pt.encode(text)
        assert ids == whole(tok, messages, TOOLS)
        if len(messages) > 2:  # only the turns since the last prompt are tokenized
            assert counting.chars - before < len(text) / 4
    assert pt.enabled


def test_encode_chat_reuses_across_conversations_and_edits(tok):
    base = [{"role": "system", "content": "Shared system prompt. " * 40}]
    a = base + [{"role": "user", "content": "first conversation"}]
    b = base + [{"role": "user", "content": "second conversation, another question"}]
    edited = a + [{"role": "assistant", "content": "ok"},
                  {"role": "user", "content": "more"}]
    edited[1] = {"role": "user", "content": "first conversation, edited after the fact"}
    for messages in (a, b, a + [{"role": "assistant", "content": "ok"},
                                {"role": "user", "content": "more"}], edited, b, a):
        assert tok.encode_chat(messages, TOOLS) == whole(tok, messages, TOOLS)
        assert tok.encode_chat(messages) == whole(tok, messages)


def chars(text: str) -> list[int]:
    """A tokenizer of one token a character; "\x01" (id 1) is its special token."""
    return [ord(c) for c in text]


def test_a_tokenizer_that_treats_its_first_text_apart_turns_reuse_off(caplog):
    """If tokenizing after a cut depended on what came before (here: a marker every call adds
    once), the check catches it, the prompt still gets the whole text's tokens, and reuse stops."""
    def tokenize(text: str) -> list[int]:
        return [0] + chars(text)

    pt = PrefixTokenizer(tokenize, {"\x01": 1})
    first = "\x01system prompt\x01user: hi"
    assert pt.encode(first) == tokenize(first)
    second = first + "\x01assistant: hello\x01user: more"
    with caplog.at_level(logging.WARNING, logger="omlx_coordinator.text.prefix_tokens"):
        assert pt.encode(second) == tokenize(second)
    assert "tokenized whole from now on" in caplog.text
    assert not pt.enabled and pt.encode(second + "\x01x") == tokenize(second + "\x01x")


def test_a_conversations_turns_keep_one_entry_and_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(prefix_tokens, "MAX_PROMPTS", 4)
    counting = []
    pt = PrefixTokenizer(lambda t: counting.append(len(t)) or chars(t), {"\x01": 1})
    text = "\x01system"
    for turn in range(10):  # one conversation: each turn supersedes the one before
        text += f"\x01turn {turn}"
        assert pt.encode(text) == chars(text)
    assert len(pt._prompts) == 1
    # Checked 3 times, then only from the last cut the turn before had: its own last turn.
    assert counting[-1] == len("\x01turn 8\x01turn 9")
    for conv in range(10):
        pt.encode(f"\x01conversation {conv}\x01hello")
    assert len(pt._prompts) == 4 and pt._tokens == sum(len(p.ids) for p in pt._prompts)


def test_an_answer_is_reused_as_generated_and_checked_from_its_cut_on(caplog):
    """An answer kept with ids other than its text's tokens (here: one id for two letters) is
    reused by the turn that renders it again, up to the special token that follows it, and
    only the part after that cut is checked against the whole text's tokens; checked so, a
    tokenizer that treats its first text apart still turns reuse off."""
    pt = PrefixTokenizer(chars, {"\x01": 1})
    prompt = "\x01system prompt\x01user: hi\x01assistant: "
    ids = pt.encode(prompt)
    pt.keep_answer(prompt, ids, "hello", [1000, 1001, ord("o")])
    turn = prompt + "hello\x01user: more"
    for _ in range(prefix_tokens.CHECKED_REUSES + 1):
        assert pt.encode(turn) == ids + [1000, 1001, ord("o")] + chars("\x01user: more")
    assert pt.encode(prompt + "hellO\x01user: more") == chars(prompt + "hellO\x01user: more")
    assert pt.enabled

    pt = PrefixTokenizer(lambda text: [0] + chars(text), {"\x01": 1})
    ids = pt.encode(prompt)
    pt.keep_answer(prompt, ids, "hello", [1000, 1001, ord("o")])
    with caplog.at_level(logging.WARNING, logger="omlx_coordinator.text.prefix_tokens"):
        assert pt.encode(turn) == [0] + chars(turn)
    assert not pt.enabled


def char_bytes(token: int) -> bytes:
    """`chars`' token spelled (ids >= 1000: "ll" and "he", two-letter pieces a model may write)."""
    return {1000: b"ll", 1001: b"he"}.get(token) or chr(token).encode()


def test_an_answer_written_back_otherwise_is_reused_up_to_where_it_differs():
    """A template that writes an answer back otherwise (here: a newline more before the call)
    gets the answer's ids up to the last one whose text it still holds there, then its own text
    tokenized from that character: the ids spell the text exactly, whatever the answer's ids
    are; a character split over tokens is cut before (no id spells half of one)."""
    pt = PrefixTokenizer(chars, {"\x01": 1}, char_bytes)
    prompt = "\x01system prompt\x01user: hi\x01assistant: "
    ids = pt.encode(prompt)
    answer = [1001, 1000, ord("o"), ord("\n"), ord("<"), ord("c"), ord(">")]  # "hello\n<c>"
    pt.keep_answer(prompt, ids, "hello\n<c>", answer)
    turn = prompt + "hello\n\n<c>\x01user: more"
    assert pt.encode(prompt + "hel") == ids + [1001] + chars("l")  # "ll" is not all there
    for _ in range(prefix_tokens.CHECKED_REUSES + 1):  # the checks pass, then no check is run
        got = pt.encode(turn)
        assert got == ids + answer[:4] + chars("\n<c>\x01user: more")
        assert b"".join(map(char_bytes, got)) == turn.encode()
    # Turn 3 reuses turn 2's ids (with the answer's) through the cut after the answer, which
    # turn 2's entry holds: the answer's own entry is dropped.
    assert pt.encode(turn + "\x01ok") == got + chars("\x01ok")
    assert not pt._answers and pt.enabled

    # "é" is two bytes, one a token (as byte-level BPE may write a character).
    pt = PrefixTokenizer(chars, {"\x01": 1}, lambda t: {900: b"\xc3", 901: b"\xa9"}.get(t)
                         or char_bytes(t))
    ids = pt.encode(prompt)
    pt.keep_answer(prompt, ids, "he\u00e9!", [1001, 900, 901, ord("!")])
    assert pt.encode(prompt + "he\u00e9?") == ids + [1001, 900, 901] + chars("?")
    pt.keep_answer(prompt, ids, "he\u00e9!", [1001, 900, 901, ord("!")])
    assert pt.encode(prompt + "he\u00e8") == ids + [1001] + chars("\u00e8")


def test_a_tokenizer_that_adds_a_space_before_its_text_reuses_answers_only_to_a_cut(caplog):
    """Where tokenizing text alone does not spell it (SentencePiece's dummy prefix: a space
    first), reuse from inside an answer stops, and answers are reused only up to a cut."""
    def tokenize(text: str) -> list[int]:
        return chars(re.sub(r"(^|(?<=\x01))(?=[^\x01])", " ", text))

    def spell(token: int) -> bytes:
        return char_bytes(token)

    pt = PrefixTokenizer(tokenize, {"\x01": 1}, spell)
    prompt = "\x01system\x01assistant:"
    ids = pt.encode(prompt)
    pt.keep_answer(prompt, ids, "hello", [1001, 1000, ord("o")])
    with caplog.at_level(logging.WARNING, logger="omlx_coordinator.text.prefix_tokens"):
        assert pt.encode(prompt + "hello!\x01more") == tokenize(prompt + "hello!\x01more")
    assert "only up to a special token" in caplog.text and pt.enabled
    assert pt.encode(prompt + "hello\x01more") == ids + [1001, 1000, ord("o")] + tokenize(
        "\x01more")


def test_kept_answers_are_bounded_and_dropped_once_a_turn_holds_them(monkeypatch):
    """Each of a prompt's answers (n choices, retries) is kept, the newest MAX_ANSWERS; the one
    a later turn went on with is dropped once that turn is kept (its ids hold the answer's)."""
    monkeypatch.setattr(prefix_tokens, "MAX_ANSWERS", 2)
    pt = PrefixTokenizer(chars, {"\x01": 1}, char_bytes)
    prompt = "\x01system\x01assistant:"
    ids = pt.encode(prompt)
    for answer in ([1000, *chars("ama")], [1001, 1000], [1001, 1000, ord("o")]):
        pt.keep_answer(prompt, ids, b"".join(map(char_bytes, answer)).decode(), answer)
    assert len(pt._prompts) == 2  # the prompt's own entry is held by its answers
    assert pt.encode(prompt + "hell\x01x") == ids + [1001, 1000] + chars("\x01x")
    assert pt.encode(prompt + "llama\x01x") == chars(prompt + "llama\x01x")  # 2 kept
    (kept,) = pt._answers.values()  # "hello", beside the two turns' own entries
    assert [list(p.ids[len(ids):]) for p in kept] == [[1001, 1000, ord("o")]]
    assert len(pt._prompts) == 3 and pt._tokens == sum(p.size for p in pt._prompts)
