"""Stage runner: layers [start, end) of an mlx-lm model, and nothing else.

The first stage embeds token ids, the last applies the final norm and the LM head (tied or not);
single-Mac mode is the one stage that is both. The model classes, loader and KV caches are
mlx-lm's own: a stage only keeps a slice of `model.layers`, so a node never reads the weights of
layers it does not run (mx.load is lazy, and dropped layers are never evaluated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import dequantize_model, load_config, load_model

from omlx_shared.model_store import SHARD_RECORD, ModelError, read_shard_record
from omlx_shared.safetensors_header import read_header

# Families whose mlx-lm classes share the layout a stage relies on:
# model.embed_tokens, model.layers[i](h, mask, cache), model.norm, lm_head or tied embeddings.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class StageError(ValueError):
    """A model or layer range this node cannot run; the message says why and what to do."""


@dataclass(frozen=True)
class ShardInfo:
    model_type: str
    num_layers: int
    layer_start: int
    layer_end: int
    dtype: str
    max_context: int
    load_seconds: float

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.num_layers


def compute_dtype(model_dtype: mx.Dtype) -> mx.Dtype:
    """float32 on a CPU, where MLX's bf16/fp16 kernels are several times slower; else unchanged."""
    return mx.float32 if mx.default_device() == mx.cpu else model_dtype


def _check_family(config: dict, path: Path) -> None:
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_FAMILIES:
        raise StageError(
            f"model family {model_type!r} ({path}) is not supported; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise StageError(
            f"{path}: sliding-window attention layers are not supported yet "
            f"(layer_types={sorted(set(layer_types))})"
        )


def _check_loaded(model: nn.Module, path: Path, start: int, end: int, num_layers: int) -> None:
    """Raises StageError unless the folder's files held every parameter layers [start, end)
    and this stage's embedding/norm/head need."""
    present: set[str] = set()
    for f in path.glob("model*.safetensors"):
        present.update(read_header(f).tensors)
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    first, last = start == 0, end == num_layers
    kept = [f"model.layers.{i}." for i in range(start, end)]
    if first or (last and tied):
        kept.append("model.embed_tokens.")
    if last:
        kept += ["model.norm."] + ([] if tied else ["lm_head."])
    missing = [name for name, _ in tree_flatten(model.parameters())
               if name.startswith(tuple(kept)) and name not in present]
    if missing:
        layers = sorted({int(n.split(".")[2]) for n in missing if n.startswith("model.layers.")})
        parts = sorted({n.split(".")[-2] for n in missing if not n.startswith("model.layers.")})
        raise StageError(
            f"{path} lacks weights of layers [{start}, {end}): "
            f"{len(missing)} tensors missing (layers {layers or 'none'}"
            f"{', ' + ', '.join(parts) if parts else ''}; e.g. {missing[0]}). The coordinator "
            f"sends a node its layers before loading them; this folder holds "
            f"{_held(path)}.")


def _held(path: Path) -> str:
    try:
        record = read_shard_record(path)
    except ModelError as e:
        return str(e)
    return record.describe() if record else "no shard record"


class StageRunner:
    """Runs one contiguous slice of a model's layers on this node."""

    def __init__(self, model_path: Path | str, layer_start: int = 0, layer_end: int | None = None):
        t0 = time.perf_counter()
        path = Path(model_path)
        config = load_config(path)
        _check_family(config, path)
        num_layers = int(config["num_hidden_layers"])
        end = num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < end <= num_layers:
            raise StageError(
                f"layer range [{layer_start}, {end}) is not inside the model's "
                f"{num_layers} layers"
            )

        # A shard folder (omlx_node/weight_store.py) holds only some layers' tensors: the others
        # keep their random initialisation, which _check_loaded makes sure this stage never runs.
        shard = (path / SHARD_RECORD).is_file()
        model, _ = load_model(path, lazy=True, strict=not shard)
        if shard:
            _check_loaded(model, path, layer_start, end, num_layers)
        inner = model.model
        self.layers = inner.layers[layer_start:end]
        is_first, is_last = layer_start == 0, end == num_layers
        tied = bool(getattr(model.args, "tie_word_embeddings", False))
        # Only the modules this stage runs stay referenced, so only they are ever read from disk.
        self.embed_tokens = inner.embed_tokens if is_first or (is_last and tied) else None
        self.norm = inner.norm if is_last else None
        self.lm_head = getattr(model, "lm_head", None) if is_last and not tied else None
        self._tied = tied
        inner.layers = self.layers

        kept = nn.Module()
        kept.layers = self.layers
        for name in ("embed_tokens", "norm", "lm_head"):
            if getattr(self, name) is not None:
                setattr(kept, name, getattr(self, name))
        target = compute_dtype(kept.layers[0].input_layernorm.weight.dtype)
        if mx.default_device() == mx.cpu:
            # Quantized matmul on a CPU runs ~1 tok/s: dequantize there, keep it elsewhere.
            dequantize_model(kept)
            kept.set_dtype(target)
            self.embed_tokens = kept.get("embed_tokens")
            self.lm_head = kept.get("lm_head")
        mx.eval(kept.parameters())
        self._module = kept

        self.info = ShardInfo(
            model_type=config["model_type"],
            num_layers=num_layers,
            layer_start=layer_start,
            layer_end=end,
            dtype=str(target).removeprefix("mlx.core."),
            max_context=int(config.get("max_position_embeddings") or 0),
            load_seconds=time.perf_counter() - t0,
        )

    @property
    def hidden_size(self) -> int:
        return self.layers[0].input_layernorm.weight.shape[0]

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def nbytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self._module.parameters()))

    def __call__(self, x: mx.array, cache: list, last_only: bool = False) -> mx.array:
        """Token ids (B, L) on the first stage, hidden states (B, L, D) on the others.

        Returns logits (B, L', V) on the last stage and hidden states otherwise;
        `last_only` keeps only the last position's logits (prefill needs no others).
        """
        h = self.embed_tokens(x) if self.info.is_first else x
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        if not self.info.is_last:
            return h
        if last_only:
            h = h[:, -1:, :]
        h = self.norm(h)
        return self.embed_tokens.as_linear(h) if self._tied else self.lm_head(h)
