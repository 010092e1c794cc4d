"""Convert a llama.cpp GGUF file into an mlx-lm model folder.

Quantized tensors stay quantized: Q8_0, Q4_0 and Q4_1 blocks (32 values, one scale, an implicit
or explicit offset) are exactly MLX affine quantization with group size 32, so the integers are
only repacked and the dequantized weights equal the GGUF's, bit for bit. Scales and offsets are
stored as float32: GGUF keeps them in float16, but d*q+m evaluated in float16 would round, and
float32 is the fast path of MLX's CPU backend (a 4-bit model with float32 scales decodes faster
there than the same model dequantized to float32).

Architectures (`_ARCHITECTURES`): llama, qwen2, qwen3, qwen3moe (the experts' stacked 3-D tensors
become mlx-lm's switch_mlp, quantized per expert row as the GGUF is), gemma3 (text; llama.cpp
stores Gemma's norm scales as 1 + w, and mlx-lm adds the 1 itself, so 1 is taken off: the scale
the model multiplies by is then the GGUF's own, exactly, for every scale of at least 0.5) and
phi3 (its fused qkv and gate-up matrices are mlx-lm's fused ones; LongRoPE factors, as
Phi-3.5 and Phi-4-mini ship them, become mlx-lm's longrope scaling).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import mlx.core as mx
import numpy as np
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from omlx_shared.gguf_bpe import UnsupportedVocabulary, byte_level_bpe
from omlx_shared.model_store import ModelError, models_dir, validate_model_dir
from omlx_shared.progress import ProgressLines, on_terminal

GROUP_SIZE = 32

# GGUF name -> the mlx-lm / Hugging Face parameter name, as most architectures have them.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Phi-3's LongRoPE factors: read into the config, not tensors of the model.
_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class _Arch:
    """How one GGUF architecture becomes an mlx-lm model."""

    model_type: str
    architecture: str  # the Hugging Face class config.json names
    permute_qk: bool = False  # llama.cpp permuted q/k rows to GGML's RoPE layout (LlamaModel)
    norm_shift: float = 0.0  # llama.cpp stored each norm scale plus this (Gemma's 1 + w)
    layer_tensors: dict[str, str] | None = None  # where it differs from _LAYER_TENSORS


_ARCHITECTURES = {
    "llama": _Arch("llama", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": _Arch("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": _Arch("gemma3_text", "Gemma3ForCausalLM", norm_shift=1.0, layer_tensors={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }),
    "phi3": _Arch("phi3", "Phi3ForCausalLM", layer_tensors={"ffn_up": "mlp.gate_up_proj"}),
}

# One safetensors file is flushed once it holds this much, so a large GGUF never sits in
# memory twice (the GGUF itself is memory-mapped).
_SHARD_BYTES = 4 << 30


def _unpack_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Block: f16 d, int8 q[32]; w = d*q. As unsigned u = q+128 (the sign bit flipped),
    # w = d*u - 128*d.
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    u = blocks[..., 2:34] ^ np.uint8(0x80)
    return u, d, -128.0 * d


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # ggml puts value j in the low nibble of byte j and value j+16 in its high nibble.
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _unpack_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Block: f16 d, 16 bytes of nibbles; w = d*(q-8).
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return _nibbles(blocks[..., 2:18]), d, -8.0 * d


def _unpack_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Block: f16 d, f16 m, 16 bytes of nibbles; w = d*q + m.
    dm = blocks[..., 0:4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[..., 4:20]), dm[..., 0], dm[..., 1]


@dataclass(frozen=True)
class _QuantType:
    bits: int
    block_bytes: int
    unpack: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


_QUANT_TYPES = {
    "Q8_0": _QuantType(8, 34, _unpack_q8_0),
    "Q4_0": _QuantType(4, 18, _unpack_q4_0),
    "Q4_1": _QuantType(4, 20, _unpack_q4_1),
}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints (rows, groups, 32) the way mx.quantize does: value i of each uint32
    word in bits [bits*i, bits*(i+1)), little-endian."""
    rows = q.shape[0]
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << np.uint8(4))
    return np.ascontiguousarray(q.reshape(rows, -1)).view(np.uint32)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute of q/k rows (it converts HF's rotate-half RoPE layout
    to GGML's interleaved one). Rows are whole, so it applies to packed weights and scales too."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def import_gguf(gguf_path: Path, dest: Path | None = None, progress: bool = True) -> Path:
    """Convert `gguf_path` into an mlx-lm model folder and return it.

    `dest` defaults to `models_dir()/<general.name>`. The folder is built in a hidden temp folder
    next to `dest` and renamed into place at the end, so a crash never leaves half a model.
    """
    gguf_path = Path(gguf_path)
    if gguf_path.is_dir():
        raise ModelError(f"{gguf_path} is a folder: name the .gguf file itself.")
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file {gguf_path} does not exist.")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # gguf's reader meets a cut-off file with whatever fails first
        raise ModelError(f"{gguf_path} is not a readable GGUF file (truncated or not GGUF?): "
                         f"{type(e).__name__}: {e}") from e
    meta = _Metadata(reader)

    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelError(
            f"{gguf_path.name} holds a {arch!r} model; only {', '.join(_ARCHITECTURES)} GGUF "
            f"files can be imported."
        )
    plan = _plan_tensors(reader, gguf_path.name, _ARCHITECTURES[arch])
    config = _model_config(meta, arch, reader)

    if dest is None:
        dest = models_dir() / _model_name(meta, gguf_path)
    dest = Path(dest)
    if dest.exists():
        raise ModelError(f"{dest} already exists; remove it first or choose another destination.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".importing", dir=dest.parent))
    try:
        quantized = _convert_tensors(plan, _ARCHITECTURES[arch], config, tmp, progress,
                                     f"importing {gguf_path.name}")
        config.update(_quantization_config(plan, quantized))
        config.update(_write_tokenizer(meta, arch, tmp, config["max_position_embeddings"]))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        validate_model_dir(tmp)
        # mkdtemp made it 0700, and so it stays: weights are private (private_files.py).
        try:
            tmp.rename(dest)
        except OSError as e:
            raise ModelError(f"Cannot move the imported model to {dest}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


class _Metadata:
    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelError(f"The GGUF file lacks the metadata key {key!r}.")
        return value


def _model_name(meta: _Metadata, gguf_path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", meta.get("general.name") or "").strip("-.")
    return name or gguf_path.stem


@dataclass(frozen=True)
class _Planned:
    tensor: gguf.ReaderTensor
    name: str  # mlx-lm parameter name
    type_name: str


def _plan_tensors(reader: gguf.GGUFReader, filename: str, arch: _Arch) -> list[_Planned]:
    """Map every tensor to its mlx-lm name and check its type, before any slow work."""
    layer_tensors = {**_LAYER_TENSORS, **(arch.layer_tensors or {})}
    plan = []
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if tensor.name == "rope_freqs.weight":
            raise ModelError(
                f"{filename} uses per-frequency RoPE scaling (Llama 3.1-style rope_freqs), "
                f"which this importer does not convert yet."
            )
        if tensor.name in _ROPE_FACTORS and arch.model_type == "phi3":
            continue  # read by _model_config
        if tensor.name in _GLOBAL_TENSORS:
            name = _GLOBAL_TENSORS[tensor.name]
        elif (m := _LAYER_TENSOR.fullmatch(tensor.name)) and m[2] in layer_tensors:
            name = f"model.layers.{m[1]}.{layer_tensors[m[2]]}.{m[3]}"
        else:
            raise ModelError(f"{filename} holds a tensor this importer does not know: {tensor.name}.")
        if type_name not in _FLOAT_TYPES and type_name not in _QUANT_TYPES:
            supported = ", ".join(_FLOAT_TYPES + tuple(_QUANT_TYPES))
            raise ModelError(
                f"{filename} stores {tensor.name} as {type_name}, which this importer cannot "
                f"convert (supported: {supported}). Re-quantize the model with llama.cpp to "
                f"one of those types, e.g. `llama-quantize --allow-requantize IN.gguf OUT.gguf Q8_0`."
            )
        if type_name in _QUANT_TYPES and len(tensor.shape) not in (2, 3):
            raise ModelError(f"{filename}: quantized tensor {tensor.name} is not a matrix (or "
                             f"a stack of expert matrices).")
        plan.append(_Planned(tensor, name, type_name))
    return plan


def _model_config(meta: _Metadata, arch: str, reader: gguf.GGUFReader) -> dict:
    p = f"{arch}."
    n_head = int(meta.require(p + "attention.head_count"))
    n_kv_head = meta.get(p + "attention.head_count_kv", n_head)
    if isinstance(n_kv_head, list):
        raise ModelError("GGUF files with a per-layer number of KV heads are not supported.")
    hidden = int(meta.require(p + "embedding_length"))
    head_dim = int(meta.get(p + "attention.key_length", hidden // n_head))
    rope_dims = meta.get(p + "rope.dimension_count", head_dim)
    if rope_dims != head_dim and arch != "phi3":  # phi3's mlx-lm class has a partial RoPE
        raise ModelError(f"Partial RoPE ({rope_dims} of {head_dim} dims) is not supported.")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelError("The GGUF file has no token_embd.weight tensor.")

    layers = int(meta.require(p + "block_count"))
    config = {
        "architectures": [_ARCHITECTURES[arch].architecture],
        "model_type": _ARCHITECTURES[arch].model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get(p + "feed_forward_length")
                                 or meta.require(p + "expert_feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_kv_head),
        "head_dim": head_dim,
        # GGUF stores these as float32; 7 significant digits give back the source's 1e-05.
        "rms_norm_eps": _f32(meta.require(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF lists dims innermost first
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(meta.require(p + "rope.scaling.factor"))}
    elif scaling not in ("none", "longrope") or (scaling == "longrope" and arch != "phi3"):
        raise ModelError(f"RoPE scaling {scaling!r} is not supported by this importer.")

    if arch == "qwen3moe":
        # Layers without expert tensors are dense (Qwen's mlp_only_layers).
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
        config |= {
            "num_experts": int(meta.require(p + "expert_count")),
            "num_experts_per_tok": int(meta.require(p + "expert_used_count")),
            "moe_intermediate_size": int(meta.require(p + "expert_feed_forward_length")),
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense,
            "norm_topk_prob": True,  # llama.cpp always renormalises Qwen3-MoE's top-k weights
        }
    elif arch == "gemma3":
        config |= {
            "sliding_window": int(meta.require(p + "attention.sliding_window")),
            "sliding_window_pattern": 6,  # llama.cpp's, as Gemma 3's every-sixth global layer
            "rope_local_base_freq": _f32(meta.get(p + "rope.freq_base_swa", 10000.0)),
            # As llama.cpp: Gemma 3 27B scales queries by hidden / heads, the others by head_dim.
            "query_pre_attn_scalar": hidden // n_head if layers == 62 else head_dim,
        }
    elif arch == "phi3":
        config["partial_rotary_factor"] = rope_dims / head_dim
        config["original_max_position_embeddings"] = int(
            meta.get(p + "rope.scaling.original_context_length", config["max_position_embeddings"]))
        if "rope_factors_long.weight" in tensors:
            config["rope_scaling"] = {
                "type": "longrope",
                "long_factor": _floats(tensors["rope_factors_long.weight"]),
                "short_factor": _floats(tensors["rope_factors_short.weight"]),
            }
    return config


def _floats(tensor: gguf.ReaderTensor) -> list[float]:
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _f32(value: float) -> float:
    return float(f"{value:.7g}")


def _convert_tensors(plan: list[_Planned], arch: _Arch, config: dict, folder: Path,
                     progress: bool, what: str) -> dict[str, int]:
    """Write the weights as safetensors shards; return {module path: bits} of quantized ones."""
    permuted_heads = {}
    if arch.permute_qk:
        permuted_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}

    quantized: dict[str, int] = {}
    shard: dict[str, mx.array] = {}
    shard_bytes = 0
    shard_files: list[tuple[Path, list[str]]] = []

    def flush() -> None:
        nonlocal shard_bytes
        path = folder / f"model-{len(shard_files) + 1:05d}.safetensors"
        mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
        shard_files.append((path, list(shard)))
        shard.clear()
        shard_bytes = 0

    columns = (TextColumn("[bold]Importing GGUF"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn(), TextColumn("{task.description}"))
    # Off a terminal the bar draws nothing: a few lines say how far a long import is.
    lines = ProgressLines(what, len(plan), "tensors") if progress and not on_terminal() else None
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("", total=len(plan))
        for i, item in enumerate(plan, 1):
            bar.update(task, description=item.tensor.name)
            module = item.name.rpartition(".")[0]
            n_head = permuted_heads.get(module.rpartition(".")[2])
            shift = arch.norm_shift if module.endswith("norm") else 0.0
            for name, array in _convert_tensor(item, n_head, shift).items():
                shard[f"{module}.{name}"] = array
                shard_bytes += array.nbytes
            if item.type_name in _QUANT_TYPES:
                quantized[module] = _QUANT_TYPES[item.type_name].bits
            if shard_bytes >= _SHARD_BYTES:
                flush()
            bar.advance(task)
            if lines is not None:
                lines.update(i)
    if shard:
        flush()

    _name_shards(folder, shard_files)
    return quantized


def _convert_tensor(item: _Planned, n_head: int | None, shift: float = 0.0) -> dict[str, mx.array]:
    """The mlx-lm arrays of one GGUF tensor; `shift` is taken off a norm scale (in float32)."""
    tensor, kind = item.tensor, item.name.rpartition(".")[2]
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if item.type_name in _QUANT_TYPES:
        qtype = _QUANT_TYPES[item.type_name]
        # A stack of expert matrices (experts, rows, cols) is quantized row by row like one
        # matrix of experts * rows rows; MLX's quantized switch layers take it back as a stack.
        *lead, cols = shape
        rows = math.prod(lead)
        blocks = np.asarray(tensor.data).reshape(rows, cols // GROUP_SIZE, qtype.block_bytes)
        q, scales, biases = qtype.unpack(blocks)
        arrays = {k: v.reshape(*lead, -1) for k, v in
                  {"weight": _pack(q, qtype.bits), "scales": scales, "biases": biases}.items()}
    elif shift:
        values = np.asarray(tensor.data)
        if item.type_name == "BF16":
            values = (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        arrays = {kind: values.astype(np.float32).reshape(shape) - np.float32(shift)}
    elif item.type_name == "BF16":
        # numpy has no bfloat16: move the raw 16-bit words and reinterpret them in MLX.
        arrays = {kind: np.asarray(tensor.data).view(np.uint16).reshape(shape)}
    else:
        arrays = {kind: np.asarray(tensor.data).reshape(shape)}
    if n_head is not None:
        arrays = {k: _unpermute_rows(v, n_head) for k, v in arrays.items()}
    out = {k: mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()}
    if item.type_name == "BF16" and not shift:
        out[kind] = out[kind].view(mx.bfloat16)
    return out


def _name_shards(folder: Path, shard_files: list[tuple[Path, list[str]]]) -> None:
    """One shard becomes model.safetensors; several get HF names and an index, which tells a
    pipeline stage which files hold its layers."""
    if len(shard_files) == 1:
        shard_files[0][0].rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, (path, names) in enumerate(shard_files, start=1):
        final = folder / f"model-{i:05d}-of-{len(shard_files):05d}.safetensors"
        path.rename(final)
        weight_map.update({name: final.name for name in names})
    size = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _quantization_config(plan: list[_Planned], quantized: dict[str, int]) -> dict:
    """mlx-lm's per-module quantization map: the common bit width at the top, other widths as
    overrides, and `false` for matrices kept in float so the loader never quantizes them."""
    if not quantized:
        return {}
    default_bits = Counter(quantized.values()).most_common(1)[0][0]
    quantization: dict = {"group_size": GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for item in plan:
        module = item.name.rpartition(".")[0]
        bits = quantized.get(module)
        if bits is not None and bits != default_bits:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        elif bits is None and item.name.endswith(".weight") and len(item.tensor.shape) in (2, 3):
            quantization[module] = False
    # As mlx-lm's save_config: the same map under both keys.
    return {"quantization": quantization, "quantization_config": quantization}


def _backend(arch: str, spec: dict):
    """The `tokenizers` tokenizer of a GGUF's vocabulary: transformers' builders where this
    transformers has them, else omlx_shared.gguf_bpe's for the vocabularies it knows (the
    default model's among them)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        try:
            return byte_level_bpe(spec)
        except UnsupportedVocabulary as e:
            import transformers

            raise ModelError(
                f"this GGUF's tokenizer needs transformers' GGUF tokenizer support, which "
                f"transformers {transformers.__version__} lacks ({e}): upgrade transformers, or "
                f"import the model where it is newer and copy the folder") from None
    return convert_gguf_tokenizer(arch, spec)[0]


def _write_tokenizer(meta: _Metadata, arch: str, folder: Path, context_length: int) -> dict:
    """Write tokenizer.json and tokenizer_config.json; return the config.json token ids.

    The vocabulary and merges are handed to transformers' own GGUF tokenizer builders, which know
    each pre-tokenizer llama.cpp names (`_backend`; omlx_shared.gguf_bpe where transformers has
    none). Their entry point reads the file through torch, so the metadata is read here with
    gguf instead.
    """
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelError(f"GGUF tokenizer type {kind!r} is not supported (only gpt2 BPE and llama SPM).")
    tokens = meta.require("tokenizer.ggml.tokens")
    spec = {
        "tokenizer_type": kind,
        "pre_tokenizer_type": meta.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": meta.get("tokenizer.ggml.token_type"),
        "merges": meta.get("tokenizer.ggml.merges"),
        "scores": meta.get("tokenizer.ggml.scores"),
    }
    backend = _backend(arch, {k: v for k, v in spec.items() if v is not None})

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else tokens[token_id]

    # llama.cpp adds BOS for an SPM vocabulary unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=context_length,
    )
    wrapper.save_pretrained(str(folder))
    tokenizer_config = folder / "tokenizer_config.json"
    saved = json.loads(tokenizer_config.read_text())
    # The generic class name loads on transformers 4 and 5 alike, and so does a chat template
    # kept here (transformers 5 saves it only to chat_template.jinja).
    saved["tokenizer_class"] = "PreTrainedTokenizerFast"
    if wrapper.chat_template:
        saved["chat_template"] = wrapper.chat_template
    tokenizer_config.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")

    # llama.cpp stops at every end-of-generation token; mlx-lm reads the list from config.json.
    eos_ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos_ids if i is not None))
    ids = {}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        ids["bos_token_id"] = int(meta.get("tokenizer.ggml.bos_token_id"))
    if eos_ids:
        ids["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return ids
