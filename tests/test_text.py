"""Detokenizing streamed ids and matching stop strings (coordinator side, no MLX involved)."""

from __future__ import annotations

import random

import pytest

from omlx_coordinator.errors import APIError
from omlx_coordinator.request.stop_strings import StopMatcher
from omlx_coordinator.text.tokenizer import MAX_CHARS_PER_TOKEN, ChatTokenizer
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


def test_a_prompt_longer_than_the_context_could_hold_is_refused_untokenized(tokenizer):
    """More characters than MAX_CHARS_PER_TOKEN a token of the context: a 400 before the
    tokenizer spends seconds on it (both APIs' wording, which agents key on)."""
    short = ChatTokenizer(tokenizer.tokenizer.name_or_path, max_context=10)
    assert short.encode("x" * 10 * MAX_CHARS_PER_TOKEN)  # at the limit: tokenized
    for call in (lambda: short.encode("x" * (10 * MAX_CHARS_PER_TOKEN + 1)),
                 lambda: short.encode_chat([{"role": "user", "content": "x" * 400}])):
        with pytest.raises(APIError) as e:
            call()
        assert e.value.code == "context_length_exceeded"
        assert e.value.message.startswith("prompt is too long:")


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


def _reference(stops: list[str], chunks: list[str]) -> list[tuple[str, bool]]:
    """What a stop matcher must answer, by brute force: the earliest stop string found ends
    the text; else everything but the longest tail that starts some stop string goes out."""
    out, pending = [], ""
    for chunk in chunks:
        pending += chunk
        hits = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
        if hits:
            out.append((pending[:min(hits)[0]], True))
            return out
        hold = max((k for s in stops for k in range(1, min(len(s), len(pending) + 1))
                    if pending.endswith(s[:k])), default=0)
        out.append((pending[:len(pending) - hold], False))
        pending = pending[len(pending) - hold:]
    return out


def test_stop_matcher_agrees_with_brute_force_on_random_text():
    """Over a small alphabet (so that stop strings overlap, repeat themselves and half-match
    all the time), fed in random pieces."""
    rng = random.Random(5)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        m = StopMatcher(stops)
        got = []
        for chunk in chunks:
            got.append(m.feed(chunk))
            if got[-1][1]:
                break
        assert got == _reference(stops, chunks), (stops, chunks)


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


def _spm_byte_fallback_tokenizer(dest):
    """A Llama-2-style tokenizer: SentencePiece pieces ("▁" for a space) whose BPE falls back
    to byte pieces (<0xE6>) for characters outside its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "▁h", "he", "ll", "▁he", "▁hell", "▁hello", "w", "r",
                  "d", "▁w", "▁wo", "or", "ld", "c", "a", "f", "é"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(dest)
    (dest / "config.json").write_text('{"eos_token_id": 2}')
    return ChatTokenizer(dest)


def test_token_bytes_make_the_text_where_tokens_split_characters(tokenizer, tmp_path):
    """OpenAI's logprobs `bytes`: a token holding part of a multi-byte character has that
    part's bytes (its text alone is U+FFFD), so a client joining them gets the text back."""
    spm = _spm_byte_fallback_tokenizer(tmp_path)
    for tok, text in ((tokenizer, " Émile café naïve 東京 🙂 done"), (spm, " hello wörld 東京 🙂")):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids).decode().strip() == text.strip()
        split = [i for i in ids if tok.token_string(i) == "\ufffd"]
        assert len(split) >= 4  # the text does have characters split over tokens
        assert all(len(tok.token_bytes(i)) < 4 for i in split)
