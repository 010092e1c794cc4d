"""What a model costs, layer by layer, read from its safetensors headers (never its weights).

The planner needs per-layer weight bytes, the embedding/head/norm bytes and the KV bytes per
token. Guessing them from the parameter count is wrong for quantized models (scales and biases)
and for uneven layers (some families mix layer shapes), so we read the real tensor sizes.

Only the safetensors headers are read (omlx_shared/safetensors_header.py): a few kilobytes even
for a 100 GB model, which is what lets the coordinator (which has no MLX and no weights in
memory) plan a cluster. This module must not import MLX.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from omlx_shared.safetensors_header import read_header, tensor_range, weight_files

# `model.layers.12.mlp.up_proj.scales`, also `language_model.model.layers.12...` in multimodal
# checkpoints: the layer index is what follows the `layers.` component.
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EMBED_RE = re.compile(r"(?:^|\.)embed_tokens\.")
_NORM_RE = re.compile(r"(?:^|\.)norm\.(?:weight|bias)$")
_HEAD_RE = re.compile(r"(?:^|\.)lm_head\.")
# Tensors mlx-lm's loaders drop (sanitize) and never hold in memory.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class ModelLayout:
    """Byte costs of a model's parts, as stored in its safetensors files.

    layer_bytes[i] counts every tensor of layer i (weights and, when quantized, scales/biases).
    head_bytes is 0 when tied_embeddings is True: the embedding matrix then serves as the head,
    so the last stage must hold it too (see planner). kv_bytes_per_token_per_layer is keys plus
    values for one token in one layer at the KV dtype read_layout was given.
    """

    model_id: str
    num_layers: int
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int
    norm_bytes: int
    tied_embeddings: bool
    kv_bytes_per_token_per_layer: int

    def __post_init__(self) -> None:
        if self.num_layers != len(self.layer_bytes):
            raise ValueError(
                f"num_layers={self.num_layers} but {len(self.layer_bytes)} layer sizes given"
            )
        if self.num_layers < 1:
            raise ValueError("a model needs at least one layer")
        if min(self.layer_bytes) < 0 or min(
            self.embed_bytes, self.head_bytes, self.norm_bytes, self.kv_bytes_per_token_per_layer
        ) < 0:
            raise ValueError("byte counts cannot be negative")

    @property
    def total_weight_bytes(self) -> int:
        """Every tensor mlx-lm keeps of the checkpoint, each counted once."""
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes + self.norm_bytes


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

    num_layers = int(setting("num_hidden_layers", 0))
    if num_layers < 1:
        raise ValueError(f"{model_path / 'config.json'} has no num_hidden_layers")

    layer_bytes = [0] * num_layers
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
                    raise ValueError(
                        f"tensor {name!r} is for layer {part}, but config.json says "
                        f"{num_layers} layers"
                    )
                layer_bytes[part] += size
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

    return ModelLayout(
        model_id=model_id or model_path.name,
        num_layers=num_layers,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed,
        head_bytes=0 if tied else head,
        norm_bytes=norm,
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=kv,
    )
