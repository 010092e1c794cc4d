"""What a model costs, layer by layer, read from its safetensors headers (never its weights).

The planner needs per-layer weight bytes, the embedding/head/norm bytes and what each layer's
cache costs. Guessing them from the parameter count is wrong for quantized models (scales and
biases) and for uneven layers (MoE families mix dense and expert layers), so we read the real
tensor sizes. A decode step streams all of a dense layer but only the experts its tokens are
routed to: `layer_stream_bytes` counts a layer's routed experts at their active share
(num_experts_per_tok of the experts), shared experts and everything else in full.
`layer_read_bytes` is what a layer kept on disk (omlx_node/layer_stream.py) reads at such a
step: the same share of the experts where they are stored stacked (a node then reads only the
routed ones, omlx_node/routed_experts.py), all of them where each expert is a tensor of its own.

What a layer's cache costs depends on its kind, as mlx-lm's `make_cache` of the family builds
it: full attention keeps keys and values of every token (MLA keeps one latent and one RoPE key
instead), a sliding-window layer at most its window of tokens, a linear-attention layer a state
of constant size. `layer_kv` mirrors those rules per family from config.json alone.

Only the safetensors headers are read (omlx_shared/safetensors_header.py): a few kilobytes even
for a 100 GB model, which is what lets the coordinator (which has no MLX and no weights in
memory) plan a cluster. This module must not import MLX.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from omlx_shared.model_families import refusal
from omlx_shared.safetensors_header import read_header, tensor_range, weight_files
from omlx_shared.tensor_split import (
    DIVIDED,
    group_cut,
    largest_share,
    quantization_group,
    tensor_refusal,
)

# `model.layers.12.mlp.up_proj.scales`, also `language_model.model.layers.12...` in multimodal
# checkpoints: the layer index is what follows the `layers.` component.
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.")
_NORM_RE = re.compile(r"(?:^|\.)norm\.(?:weight|bias)$")
_HEAD_RE = re.compile(r"(?:^|\.)lm_head\.")
# Tensors mlx-lm's loaders drop (sanitize) and never hold in memory: rotary tables, the
# multi-token-prediction heads (Qwen3-Next's `mtp.`; DeepSeek's and GLM's extra layers past
# num_hidden_layers are dropped in read_layout), and a multimodal checkpoint's vision parts.
_IGNORED_RE = re.compile(
    r"rotary_emb\.inv_freq$|^mtp\.|^(?:vision_tower|visual|multi_modal_projector)\.")
# Routed experts: stacked (switch_mlp, gpt-oss's experts.gate_up_proj) or one per expert.
_ROUTED_RE = re.compile(r"\.(?:switch_mlp|experts)\.")
# One tensor per expert (Hugging Face's `experts.7.up_proj`): a streamed layer reads them whole.
_PER_EXPERT_RE = re.compile(r"\.experts\.\d+\.")
# Families whose sanitize drops the layers past num_hidden_layers (their MTP layers).
_MTP_LAYER_FAMILIES = ("deepseek_v3", "kimi_k2", "glm4_moe")


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache for one sequence: `bytes_per_token` for each of at most `window` tokens
    (None: every token), plus `state_bytes` whatever the length (a recurrent state)."""

    bytes_per_token: int
    window: int | None = None
    state_bytes: int = 0

    def bytes_for(self, tokens: int) -> int:
        kept = tokens if self.window is None else min(tokens, self.window)
        return self.bytes_per_token * kept + self.state_bytes


@dataclass(frozen=True)
class ModelLayout:
    """Byte costs of a model's parts, as stored in its safetensors files.

    layer_bytes[i] counts every tensor of layer i (weights and, when quantized, scales/biases).
    head_bytes is 0 when tied_embeddings is True: the embedding matrix then serves as the head,
    so the last stage must hold it too (see planner). kv_bytes_per_token_per_layer is keys plus
    values for one token in one full-attention layer at the KV dtype read_layout was given.
    layer_kv, when given, says per layer what its cache costs (sliding-window, linear-attention
    and MLA layers differ); empty, every layer is full attention. layer_stream_bytes, when
    given, is what a decode step streams of each layer (MoE: the active experts' share); empty,
    all of layer_bytes. layer_read_bytes, when given, what a decode step at batch 1 reads of a
    layer kept on disk (stacked experts: the active share); empty, all of it. draft_bytes: a draft model's weights (`speculative = "draft=PATH"`),
    held beside the first stage's layers in its worker.
    """

    model_id: str
    num_layers: int
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    norm_bytes: int
    tied_embeddings: bool
    kv_bytes_per_token_per_layer: int
    layer_kv: tuple[LayerKV, ...] = ()
    layer_stream_bytes: tuple[int, ...] = ()
    draft_bytes: int = 0
    layer_read_bytes: tuple[int, ...] = ()
    # config.json's model_type, hidden_size, vocab_size and what a tensor-parallel split
    # divides (heads, intermediate sizes), as (key, value) pairs: `tensor_refusal` reads them.
    shape: tuple[tuple[str, int | str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.num_layers != len(self.layer_bytes):
            raise ValueError(
                f"num_layers={self.num_layers} but {len(self.layer_bytes)} layer sizes given"
            )
        for name, given in (("layer caches", self.layer_kv),
                            ("layer stream sizes", self.layer_stream_bytes),
                            ("layer read sizes", self.layer_read_bytes)):
            if given and len(given) != self.num_layers:
                raise ValueError(f"num_layers={self.num_layers} but {len(given)} {name} given")
        if self.num_layers < 1:
            raise ValueError("a model needs at least one layer")
        if min(self.layer_bytes) < 0 or min(
            self.embed_bytes, self.head_bytes, self.norm_bytes, self.kv_bytes_per_token_per_layer
        ) < 0:
            raise ValueError("byte counts cannot be negative")

    @property
    def total_weight_bytes(self) -> int:
        """Every tensor mlx-lm keeps of the checkpoint, each counted once."""
        return (sum(self.layer_bytes) + self.embed_bytes + self.head_bytes + self.norm_bytes
                + self.draft_bytes)

    def kv_bytes(self, layer: int, tokens: int) -> int:
        """What layer `layer`'s cache holds for one sequence of `tokens` tokens."""
        if self.layer_kv:
            return self.layer_kv[layer].bytes_for(tokens)
        return self.kv_bytes_per_token_per_layer * tokens

    def tensor_refusal(self, ranks: int) -> str:
        """Why the model cannot be a tensor-parallel stage of `ranks` ranks; "" if it can."""
        return tensor_refusal(dict(self.shape), ranks)

    def group_cut(self, ranks: int) -> str:
        """Why a tensor split over `ranks` would cut a quantization group of a weight kept
        quantized; "" if it would not (or the model is not quantized)."""
        shape = dict(self.shape)
        if "group_size" in shape:
            shape["quantization"] = {"group_size": shape["group_size"]}
        return group_cut(shape, ranks)

    def tensor_share(self, ranks: int) -> tuple[float, float]:
        """The largest fraction of a layer's weights, and of its KV, one of `ranks` holds."""
        return largest_share(dict(self.shape), ranks)

    @property
    def hidden_size(self) -> int:
        return int(dict(self.shape).get("hidden_size", 0))

    def stream_bytes(self, layer: int) -> int:
        """What a decode step streams of layer `layer`'s weights."""
        return (self.layer_stream_bytes or self.layer_bytes)[layer]

    def read_bytes(self, layer: int) -> int:
        """What a decode step at batch 1 reads of layer `layer` when it is kept on disk."""
        return (self.layer_read_bytes or self.layer_bytes)[layer]


def tensor_part(name: str) -> int | str | None:
    """Where a checkpoint tensor belongs: its layer index, "embed", "head", "norm", "other" (no
    part a pipeline stage knows), or None for tensors mlx-lm drops."""
    if _IGNORED_RE.search(name):
        return None
    if m := _LAYER_RE.search(name):
        return int(m.group(1))
    if _EMBED_RE.search(name):
        return "embed"
    if _HEAD_RE.search(name):
        return "head"
    if _NORM_RE.search(name):
        return "norm"
    return "other"


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of one .safetensors file (tensor name -> dtype/shape/data_offsets),
    without the `__metadata__` entry. Reads only the header bytes."""
    return read_header(path).tensors


def _tensor_bytes(name: str, info: dict, path: Path) -> int:
    start, end = tensor_range(name, info, path)
    return end - start


def read_layout(
    model_path: Path, kv_dtype_bytes: int = 2, model_id: str | None = None
) -> ModelLayout:
    """Read a model folder's layout from config.json and its safetensors headers.

    model_id defaults to the folder name (as `omlx-cluster serve` does). kv_dtype_bytes is the
    size of one KV cache element (2 for fp16/bf16 caches). Raises ValueError for a folder whose
    tensors do not map onto embedding / layers / norm / head, rather than silently under-counting.
    """
    model_path = Path(model_path)
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {model_path / 'config.json'}: {e}") from e
    # Multimodal configs nest the language model's settings.
    text = config.get("text_config") or {}

    def setting(key: str, default=None):
        value = config.get(key)
        return text.get(key, default) if value is None else value

    if why := refusal(config):
        raise ValueError(f"{model_path}: {why}")
    num_layers = int(setting("num_hidden_layers", 0))
    if num_layers < 1:
        raise ValueError(f"{model_path / 'config.json'} has no num_hidden_layers")
    model_type = str(setting("model_type", ""))
    active = _active_expert_share(setting)

    layer_bytes = [0] * num_layers
    stream_bytes = [0] * num_layers
    read_bytes = [0] * num_layers
    seen_layers: set[int] = set()
    embed = head = norm = 0
    has_head = False
    unknown: list[str] = []
    seen_names: set[str] = set()
    for path in weight_files(model_path):
        for name, info in read_safetensors_header(path).items():
            if name in seen_names:
                raise ValueError(f"tensor {name!r} appears in more than one file of {model_path}")
            seen_names.add(name)
            part = tensor_part(name)
            if part is None:
                continue
            size = _tensor_bytes(name, info, path)
            if isinstance(part, int):
                if part >= num_layers:
                    if model_type in _MTP_LAYER_FAMILIES:
                        continue  # its multi-token-prediction layer: mlx-lm drops it
                    raise ValueError(
                        f"tensor {name!r} is for layer {part}, but config.json says "
                        f"{num_layers} layers"
                    )
                layer_bytes[part] += size
                routed = _ROUTED_RE.search(name)
                stream_bytes[part] += round(size * active) if routed else size
                read_bytes[part] += round(size * active) if routed and not \
                    _PER_EXPERT_RE.search(name) else size
                seen_layers.add(part)
            elif part == "embed":
                embed += size
            elif part == "head":
                head += size
                has_head = True
            elif part == "norm":
                norm += size
            else:
                unknown.append(name)
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        shown = ", ".join(unknown[:5]) + more
        raise ValueError(
            f"{model_path}: tensors outside embedding/layers/norm/head, which a pipeline stage "
            f"would not know where to place: {shown}"
        )
    if missing := sorted(set(range(num_layers)) - seen_layers):
        raise ValueError(f"{model_path}: no tensors for layers {missing[:10]}")
    if embed == 0:
        raise ValueError(f"{model_path}: no embed_tokens tensors")

    # mlx-lm ties the head to the embedding when the config says so, which its families assume
    # when it is silent, and its sanitize then drops any lm_head tensor: that one is never
    # loaded. Without an lm_head tensor the head is the embedding, whatever the config says.
    tied = bool(setting("tie_word_embeddings", True)) or not has_head

    heads = int(setting("num_attention_heads", 0))
    kv_heads = int(setting("num_key_value_heads", 0) or heads)
    head_dim = setting("head_dim")
    if not head_dim:
        hidden = int(setting("hidden_size", 0))
        if not heads or not hidden:
            raise ValueError(f"{model_path / 'config.json'}: cannot derive head_dim")
        head_dim = hidden // heads
    kv = 2 * kv_heads * int(head_dim) * kv_dtype_bytes  # keys + values
    layer_kv = layer_caches(model_type, setting, num_layers, kv, kv_dtype_bytes)

    return ModelLayout(
        model_id=model_id or model_path.name,
        num_layers=num_layers,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed,
        head_bytes=0 if tied else head,
        norm_bytes=norm,
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=kv,
        layer_kv=layer_kv if any(c != LayerKV(kv) for c in layer_kv) else (),
        layer_stream_bytes=tuple(stream_bytes) if stream_bytes != layer_bytes else (),
        layer_read_bytes=tuple(read_bytes) if read_bytes != layer_bytes else (),
        shape=(("model_type", str(config.get("model_type", ""))),
               *((k, v) for k in ("hidden_size", "vocab_size", *(key for key, _ in DIVIDED))
                 if isinstance(v := setting(k), int)),
               ("head_dim", int(head_dim)),
               *((("group_size", g),) if (g := quantization_group(config)) else ())),
    )


def with_draft(layout: ModelLayout, draft: Path) -> ModelLayout:
    """`layout` with the weights of the draft model in folder `draft` counted on its first
    stage; ValueError where that folder cannot be read as a model."""
    return replace(layout, draft_bytes=read_layout(draft).total_weight_bytes)


def _active_expert_share(setting) -> float:
    """The share of a MoE layer's routed experts one token runs (1.0 for a dense model)."""
    experts = next((int(v) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if (v := setting(k))), 0)
    active = int(setting("num_experts_per_tok", 0) or 0)
    return min(1.0, active / experts) if experts and active else 1.0


def layer_caches(model_type: str, setting, num_layers: int, kv: int,
                 kv_dtype_bytes: int) -> tuple[LayerKV, ...]:
    """Each layer's cache as the family's mlx-lm `make_cache` builds it (see the module
    docstring); `kv` is a full-attention layer's bytes per token. `setting(key, default)`
    reads config.json (text_config included)."""
    window = setting("sliding_window")
    full, sliding = LayerKV(kv), LayerKV(kv, int(window) if window else None)
    if model_type in ("gemma3", "gemma3_text", "cohere2"):
        # Every sliding_window_pattern-th layer is global, the others slide (mlx-lm's defaults).
        p = int(setting("sliding_window_pattern", 4 if model_type == "cohere2" else 6))
        return tuple(full if i % p == p - 1 else sliding for i in range(num_layers))
    if model_type in ("deepseek_v3", "kimi_k2"):
        # MLA caches one compressed latent and one RoPE key per token, shared by all heads.
        rank, rope = int(setting("kv_lora_rank", 512)), int(setting("qk_rope_head_dim", 64))
        return (LayerKV((rank + rope) * kv_dtype_bytes),) * num_layers
    if model_type == "qwen3_next":
        # Gated DeltaNet layers keep a conv window and a float32 recurrent state per head.
        nk, nv = int(setting("linear_num_key_heads")), int(setting("linear_num_value_heads"))
        dk, dv = int(setting("linear_key_head_dim")), int(setting("linear_value_head_dim"))
        conv = (int(setting("linear_conv_kernel_dim")) - 1) * (2 * nk * dk + nv * dv)
        linear = LayerKV(0, state_bytes=conv * kv_dtype_bytes + nv * dv * dk * 4)
        every = int(setting("full_attention_interval", 4))
        return tuple(full if (i + 1) % every == 0 else linear for i in range(num_layers))
    types = setting("layer_types") or (
        ["sliding_attention", "full_attention"] * (num_layers // 2)
        if model_type == "gpt_oss" else [])
    if types and model_type in ("gpt_oss", "llama", "mistral"):
        return tuple(sliding if t == "sliding_attention" else full for t in types)
    return (full,) * num_layers


def whole_model_layout(model_path: Path, model_id: str, work_bytes: int = 0) -> ModelLayout:
    """An embedding or reranking model's layout: one part holding every tensor (plus
    `work_bytes`, what a forward pass's activations take), so the planner places it whole on
    one node (these models are small, and a pipeline would only add a hop). No KV: nothing
    stays in memory between requests."""
    total = sum(_tensor_bytes(name, info, path)
                for path in weight_files(Path(model_path))
                for name, info in read_safetensors_header(path).items())
    if total == 0:
        raise ValueError(f"{model_path}: no safetensors weights")
    return ModelLayout(model_id=model_id, num_layers=1, layer_bytes=(total + work_bytes,),
                       embed_bytes=0, head_bytes=0, norm_bytes=0, tied_embeddings=True,
                       kv_bytes_per_token_per_layer=0)
