"""A GGUF's byte-level BPE vocabulary as a `tokenizers` tokenizer, without transformers' GGUF
builders.

omlx_shared.gguf_import hands a GGUF's vocabulary to transformers' `convert_gguf_tokenizer`,
which knows every pre-tokenizer llama.cpp names; a transformers older than that function (a lent
GPU machine's) cannot import any GGUF through it, the default model's included. This builds the
vocabularies whose split is known here, byte-level BPE ("gpt2") with llama.cpp's pre-types
"gpt-2" (or none stated) and "smollm" (the default model's), as transformers would: a BPE
model over the tokens and merges the file gives, GPT-2's byte-level split (for "smollm", each digit apart first, as
SmolLM2's own tokenizer.json and llama.cpp's SMOLLM pre-type split), the byte-level decoder, the
tokens the file marks as control added as special and those it marks as user-defined as plain
added tokens. Only the `tokenizers` package is used, which every transformers brings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's token types (gguf's TokenType).
CONTROL, USER_DEFINED = 3, 4
# llama.cpp's pre-types this module builds, and whether each splits every digit apart.
PRE_TYPES = {None: False, "gpt-2": False, "smollm": True}


class UnsupportedVocabulary(ValueError):
    """A vocabulary this module does not build; the message says which and why."""


def byte_level_bpe(spec: Mapping[str, object]) -> Tokenizer:
    """The tokenizer of `spec` (tokenizer_type, pre_tokenizer_type, tokens, token_type, merges:
    the GGUF's tokenizer.ggml.* values, as omlx_shared.gguf_import reads them)."""
    kind, pre = spec.get("tokenizer_type"), spec.get("pre_tokenizer_type")
    if kind != "gpt2" or pre not in PRE_TYPES or "merges" not in spec:
        raise UnsupportedVocabulary(
            f"a {kind!r} vocabulary with pre-tokenizer {pre!r}"
            f"{'' if 'merges' in spec else ' and no merges'} (only byte-level BPE with merges "
            f"and pre-tokenizer {', '.join(str(p) for p in PRE_TYPES if p)} is built without "
            f"transformers' GGUF support)")
    tokens: Sequence[str] = spec["tokens"]  # type: ignore[assignment]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    respell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def spelled(token: str) -> str:
        # A token outside the byte alphabet (a file that wrote it as text) is spelled by bytes.
        if set(token) <= alphabet:
            return token
        return "".join(piece for piece, _ in respell.pre_tokenize_str(token))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in spec["merges"]]  # type: ignore[union-attr]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))
    tokenizer.pre_tokenizer = byte_level
    if PRE_TYPES[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    types = list(spec.get("token_type") or ())  # type: ignore[call-overload]
    # A control token outside the byte alphabet is a llama.cpp mislabel: adding it would grow
    # the vocabulary past the model's (transformers skips it too).
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind_of in zip(tokens, types) if kind_of == CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind_of in zip(tokens, types)
                          if kind_of == USER_DEFINED and t in vocab])
    return tokenizer
