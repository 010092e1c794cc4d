"""Stage runner: layers [start, end) of an mlx-lm model, and nothing else.

The first stage embeds token ids, the last applies the final norm and the LM head (tied or not);
single-Mac mode is the one stage that is both. The model classes, loader and caches are mlx-lm's
own, for any family that has the common shape (omlx_node/families.py): a stage keeps a slice of
the model's own layer list, the caches its `make_cache` gives those layers, and makes each
layer's mask from its cache as the family does (full, sliding-window, linear-attention state).
The embedding and the head run the family's own code, so its embedding scaling, logit scaling
or soft-capping need nothing here. A node never reads the weights of layers it does not run
(mx.load is lazy, and the modules of dropped layers leave the model before anything is read).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import dequantize_model, load_config, load_model

from omlx_node.families import (
    FamilyError,
    check_shape,
    embedding_view,
    find_anatomy,
    head_view,
    layer_mask,
    mask_kind,
)
from omlx_node.layer_stream import LayerStream, StreamError
from omlx_node.tensor_shard import ShardError, shard_model, split_vocab
from omlx_shared.model_families import refusal
from omlx_shared.model_store import SHARD_RECORD, ModelError, read_shard_record
from omlx_shared.safetensors_header import read_header
from omlx_shared.tensor_split import tensor_refusal


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


def _setting(config: dict, key: str, default=None):
    """A config value; multimodal configs keep the language model's under text_config."""
    value = config.get(key)
    return (config.get("text_config") or {}).get(key, default) if value is None else value


def _weights_dtype(module: nn.Module) -> mx.Dtype:
    """The floating dtype holding most of a module's bytes (quantized weights are integers;
    their scales tell the dtype they compute in)."""
    sizes: Counter = Counter()
    for _, v in tree_flatten(module.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            sizes[v.dtype] += v.nbytes
    return sizes.most_common(1)[0][0] if sizes else mx.float32


def _per_token(cache) -> bool:
    """Whether a layer cache is its tokens' keys and values, in order (what blocks hold)."""
    return type(cache) is KVCache or (type(cache) is RotatingKVCache and cache.keep == 0)


def _check_loaded(model: nn.Module, path: Path, kept: list[str],
                  stage_range: tuple[int, int]) -> None:
    """Raises StageError unless the folder's files held every parameter under the `kept`
    prefixes (this stage's layers, embedding, norm and head)."""
    present: set[str] = set()
    for f in path.glob("model*.safetensors"):
        present.update(read_header(f).tensors)
    missing = [name for name, _ in tree_flatten(model.parameters())
               if name.startswith(tuple(kept)) and name not in present]
    if missing:
        layers = sorted({int(n.split("layers.")[1].split(".")[0]) for n in missing
                         if ".layers." in n or n.startswith("layers.")})
        parts = sorted({n.split(".")[-2] for n in missing if "layers." not in n})
        raise StageError(
            f"{path} lacks weights of layers [{stage_range[0]}, {stage_range[1]}): "
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

    def __init__(self, model_path: Path | str, layer_start: int = 0, layer_end: int | None = None,
                 streamed: int = 0, tensor_group=None, split_head: bool = False):
        """`streamed`: how many of the range's last layers stay on disk (layer_stream.py); at
        least one layer of the range stays resident. `tensor_group`: the mx.distributed group
        of a tensor-parallel stage, whose ranks each hold a slice of every layer of the range
        (omlx_node/tensor_shard.py), or a SubGroup of it where the stage is one of a pipeline's
        (omlx_node/sub_group.py); None: whole layers. `split_head`: its ranks split the head
        by vocabulary too (tensor_shard.split_vocab), which needs every rank to evaluate the
        logits of every step rank 0 evaluates them for (omlx_node/tensor.py's do)."""
        t0 = time.perf_counter()
        path = Path(model_path)
        config = load_config(path)
        if why := refusal(config):
            raise StageError(f"{path}: {why}")
        num_layers = int(_setting(config, "num_hidden_layers", 0))
        end = num_layers if layer_end is None else layer_end
        if not 0 <= layer_start < end <= num_layers:
            raise StageError(
                f"layer range [{layer_start}, {end}) is not inside the model's "
                f"{num_layers} layers"
            )
        is_first, is_last = layer_start == 0, end == num_layers
        if not 0 <= streamed < end - layer_start:
            raise StageError(
                f"{streamed} streamed layers of the {end - layer_start} in [{layer_start}, "
                f"{end}): at least one layer of a stage stays in memory, and none is negative")
        ranks = 1 if tensor_group is None else tensor_group.size()
        if ranks > 1:
            if why := tensor_refusal(config, ranks):
                raise StageError(f"{path}: {why}")
        if ranks > 1 and streamed:
            raise StageError("a tensor-parallel stage keeps every layer in memory: its ranks "
                             "slice each layer, and streamed layers are read whole")

        # A shard folder (omlx_node/weight_store.py) holds only some layers' tensors: the others
        # keep their random initialisation, which _check_loaded makes sure this stage never runs.
        shard = (path / SHARD_RECORD).is_file()
        try:
            model, _ = load_model(path, lazy=True, strict=not shard)
        except (ValueError, TypeError, KeyError) as e:  # an unknown family, a config it rejects
            raise StageError(f"{path}: mlx-lm cannot load this {config.get('model_type')!r} "
                             f"model: {e}") from e
        try:
            anatomy = find_anatomy(model)
            # The family's own caches, made while the model still has all its layers (some
            # families build the list from their layer types, others from their layers).
            every = make_prompt_cache(model)
            caches = every[layer_start:end]
            inner = anatomy.inner
            inner.layers = inner.layers[layer_start:end]
            check_shape(anatomy, caches)
        except FamilyError as e:
            raise StageError(f"{path}: {e}") from e
        # Decided from every layer of the model, so all stages of a pipeline agree. Blocks hold
        # per-token keys and values: full-attention (MLA too) and sliding-window layers have
        # them; a recurrent state (linear attention, SSM) is not a sum of its tokens' parts.
        others = sorted({type(c).__name__ for c in every if not _per_token(c)})
        self.prefix_cache_off = (
            f"{anatomy.family} has {', '.join(others)} layers, whose state the prefix cache "
            f"does not cut into blocks" if others else "")
        # Its sliding-window layers drop old tokens: the prefix cache must cut each block while
        # they still hold it, so prefill chunks end on block boundaries.
        self.has_windows = any(isinstance(c, RotatingKVCache) for c in every)
        # Speculative decoding trims a step's rejected positions from every layer's cache:
        # plain KV caches only (decided from every layer, so all stages agree).
        self.trimmable = all(type(c) is KVCache for c in every)
        tied = not anatomy.head_parts()
        self._templates = caches
        self._departure = anatomy.departure
        self._num_layers = num_layers

        # Only the modules this stage runs stay in the model, so only they are ever read.
        if anatomy.lm_path:
            for key in [k for k in model.children() if k != anatomy.lm_path]:
                model.pop(key)
        if not (is_first or (is_last and tied)):
            inner.pop(anatomy.embed_key)
        if not is_last:
            inner.pop(anatomy.norm_key)
            for key in anatomy.head_parts():
                anatomy.lm.pop(key)
        if shard:
            kept = [f"{anatomy.inner_path}.layers.{i}." for i in range(layer_start, end)]
            kept += [f"{anatomy.inner_path}.{k}." for k in (anatomy.embed_key, anatomy.norm_key)
                     if k in inner]
            if is_last:
                lm = f"{anatomy.lm_path}." if anatomy.lm_path else ""
                kept += [f"{lm}{k}." for k in anatomy.head_parts()]
            _check_loaded(model, path, kept, (layer_start, end))

        target = compute_dtype(_weights_dtype(inner.layers[0]))
        # Streamed layers leave the model while it is converted and read: their weights are
        # read at each use instead (converted then as well), never here.
        layers = inner.layers
        kept = len(layers) - streamed
        inner.layers = layers[:kept]
        if mx.default_device() == mx.cpu:
            # Quantized matmul on a CPU is far too slow to serve: dequantize there, keep it
            # elsewhere.
            dequantize_model(model)
            model.set_dtype(target)
        if ranks > 1:
            # After dequantizing, which knows mlx's plain quantized layers only.
            try:
                shard_model(model, inner.layers, config, tensor_group)
                if split_head and is_last and len(anatomy.head_parts()) == 1:
                    split_vocab(anatomy.lm, anatomy.head_parts()[0], tensor_group)
            except ShardError as e:
                raise StageError(f"{path}: {e}; serve it with --parallel pipeline") from e
        mx.eval(model.parameters())
        inner.layers = layers
        self._stream: LayerStream | None = None
        if streamed:
            quantized = any(k.endswith(".scales") for k, _ in tree_flatten(
                layers[kept].parameters()))
            try:
                self._stream = LayerStream(
                    model, path, f"{anatomy.inner_path}.layers.",
                    {layer_start + i: layers[i] for i in range(kept, len(layers))},
                    None if quantized else target)
            except (StreamError, ValueError) as e:
                raise StageError(f"{path}: {e}") from e
        self._kept = kept
        self._module = model
        self.layers = inner.layers
        self.embed_tokens = inner.get(anatomy.embed_key)
        self.norm = inner.get(anatomy.norm_key)
        # Views made after dequantizing, which replaces modules: they must see the new ones.
        self._embed = embedding_view(anatomy) if is_first else None
        self._head = head_view(anatomy) if is_last else None
        self.hidden_size = int(_setting(config, "hidden_size"))
        self.path = path  # its folder: a draft model's tokenizer is checked against it

        self.info = ShardInfo(
            model_type=config["model_type"],
            num_layers=num_layers,
            layer_start=layer_start,
            layer_end=end,
            dtype=str(target).removeprefix("mlx.core."),
            max_context=int(_setting(config, "max_position_embeddings", 0) or 0),
            load_seconds=time.perf_counter() - t0,
        )

    def sample_input(self, rows: int, length: int) -> mx.array:
        """An input of this stage's kind (token ids on the first stage, hidden states on the
        others) for a forward pass whose result does not matter (a warm-up, a probe)."""
        if self.info.is_first:
            return mx.ones((rows, length), dtype=mx.int32)
        return mx.zeros((rows, length, self.hidden_size), dtype=getattr(mx, self.info.dtype))

    def make_cache(self) -> list:
        """Fresh caches for this stage's layers, of the types the family's make_cache gives."""
        return [copy.deepcopy(c) for c in self._templates]

    def from_blocks(self, restored: list[KVCache]) -> list:
        """A restored prefix (the prefix cache gives KVCaches) as this stage's layers keep it: a
        sliding-window layer's as its RotatingKVCache holding every restored token, as a cold
        prefill of them leaves it; it keeps its window from the next step on."""
        out = []
        for kv, template in zip(restored, self._templates):
            if isinstance(template, RotatingKVCache) and kv.keys is not None:
                n = kv.offset
                window = RotatingKVCache(template.max_size, template.keep)
                window.state = (kv.keys[..., :n, :], kv.values[..., :n, :], n, template.keep,
                                template.max_size, n)
                kv = window
            out.append(kv)
        return out

    def feed_forward(self) -> Callable[[mx.array], mx.array]:
        """The first layer's feed-forward block (dense or MoE), which the head times by rows to
        choose its micro-batches; the whole layer for a family that names it otherwise."""
        layer = self.layers[0]
        for name in ("mlp", "block_sparse_moe", "feed_forward"):
            if isinstance(layer.get(name), nn.Module):
                return layer[name]
        return lambda x: layer(x, None, None)

    def nbytes(self) -> int:
        """Bytes of the weights held in memory (streamed layers' are read at each use)."""
        held = sum(v.nbytes for _, v in tree_flatten(self._module.parameters()))
        return held - sum(v.nbytes for layer in self.layers[self._kept:]
                          for _, v in tree_flatten(layer.parameters()))

    @property
    def streamed_layers(self) -> int:
        return len(self.layers) - self._kept

    @property
    def streamed_bytes_read(self) -> int:
        """Bytes its streamed layers' turns have read from disk so far (routed experts: only
        those the tokens chose)."""
        return self._stream.bytes_read if self._stream else 0

    @property
    def streamed_seconds(self) -> float:
        """What a forward pass spends in its streamed layers (their reads and compute), as last
        measured; 0 for a stage that streams none, or before its first pass."""
        return self._stream.seconds_a_pass if self._stream else 0.0

    def __call__(self, x: mx.array, cache: list, last_only: bool = False) -> mx.array:
        """Token ids (B, L) on the first stage, hidden states (B, L, D) on the others.

        Returns logits (B, L', V) on the last stage and hidden states otherwise;
        `last_only` keeps only the last position's logits (prefill needs no others).
        """
        if self._embed is not None:
            # The family's embedding code gets the whole model's cache list, as in its own
            # forward (position-aware code reads the offsets of the first layers' caches); the
            # masks it makes there are never used (lazy, never evaluated).
            h = self._embed(x, cache + [None] * (self._num_layers - len(cache)))
        else:
            h = x
        masks: dict[tuple[str, int], object] = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            kind = mask_kind(c)
            if kind not in masks:
                masks[kind] = layer_mask(h, c, self._departure)
            if i < self._kept:
                h = layer(h, masks[kind], c)
            else:
                h = self._stream.run(self.info.layer_start + i,
                                     lambda: layer(h, masks[kind], c))
        if self._head is None:
            return h
        if last_only:
            h = h[:, -1:, :]
        return self._head(self.norm(h))
