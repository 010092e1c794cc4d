"""Detokenizing streamed ids and matching stop strings (coordinator side, no MLX involved)."""

from __future__ import annotations

import pytest

from omlx_coordinator.stop_strings import StopMatcher
from omlx_coordinator.tokenizer import ChatTokenizer
from tests.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ChatTokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    (path / "config.json").write_text('{"eos_token_id": 2}')
    return ChatTokenizer(path)


@pytest.mark.parametrize("prompt,completion", [
    ("The capital of France is", " Paris. Émile café naïve 東京 🙂 done"),
    ("Hello", " world!\n\ndef add(a, b):\n    return a + b"),
])
def test_incremental_detokenizer_reproduces_decoded_text(tokenizer, prompt, completion):
    p_ids = tokenizer.encode(prompt)
    c_ids = tokenizer.encode(completion)
    detok = tokenizer.detokenizer(p_ids)
    pieces = [detok.add(t) for t in c_ids]
    pieces.append(detok.flush())
    text = "".join(pieces)
    assert prompt + text == tokenizer.decode(p_ids + c_ids)
    assert text.startswith(" ")  # the leading space mlx_lm.server drops
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_eos_ids_and_chat_template(tokenizer):
    assert 2 in tokenizer.eos_token_ids
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids).endswith("assistant\n")


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>", "STOP"])
    assert m.feed("Hello </e") == ("Hello ", False)
    assert m.feed("nx") == ("</enx", False)
    assert m.feed(" and ST") == (" and ", False)
    assert m.feed("OP more") == ("", True)


def test_stop_matcher_earliest_stop_and_flush():
    m = StopMatcher(["b", "abc"])
    assert m.feed("xxab") == ("xxa", True)
    m = StopMatcher(["zz"])
    assert m.feed("az") == ("a", False)
    assert m.flush() == "z"
    assert StopMatcher([]).feed("anything") == ("anything", False)
