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


def test_a_chunk_of_tokens_counts_only_those_up_to_the_stop_string(tokenizer):
    """A node sends several steps' tokens in one chunk: the text stops where the stop string
    starts, and the tokens answered are those up to the one that completed it, as if they had
    come one at a time."""
    prompt = tokenizer.encode("Hello")
    completion = tokenizer.encode(" world! How are you today? Fine, thanks.")
    text = tokenizer.decode(prompt + completion)[len("Hello"):]
    stop = "are you"
    one_by_one, m = tokenizer.detokenizer(prompt), StopMatcher([stop])
    for n, token in enumerate(completion, 1):
        if m.feed(one_by_one.add(token))[1]:
            break
    chunked, m = tokenizer.detokenizer(prompt), StopMatcher([stop])
    out, hit, taken = m.feed_tokens(chunked, completion, last=True)
    assert hit and out == text[:text.index(stop)] and taken == n < len(completion)
    # No stop string reached: every token counts, the held-back text flushed at the end.
    chunked, m = tokenizer.detokenizer(prompt), StopMatcher(["never there"])
    out, hit, taken = m.feed_tokens(chunked, completion, last=True)
    assert not hit and out + m.flush() == text and taken == len(completion)
