"""Splits a loaded model's layers over the ranks of a tensor-parallel stage.

Which sharder, and why, is decided in omlx_shared/tensor_split.py: mlx-lm's own `Model.shard()`
where the family has one and the rank count divides what it splits, else the generic sharder
here, for families of the common decoder shape. The generic sharder does what llama's shard()
does (q, k, v column-sharded by heads, o row-sharded; gate and up column-sharded, down
row-sharded; the attention's head counts set to the rank's), with two differences: the runs need
not be equal (each rank's from `head_slice` and `share`), and a KV head may be held by more than
one rank (its rows repeated), so its slicing is its own rather than mlx's `shard_linear`, which
splits evenly. A column-sharded projection is a plain Linear holding its rows (mlx's
AllToShardedLinear differs only in its training gradients); a row-sharded one adds the ranks'
partial sums (`RowSharded`), one all_sum after attention and one after the MLP, as mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from omlx_shared.tensor_split import head_slice, share, uses_model_shard

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "mlp": ("gate_proj", "up_proj", "down_proj")}


class ShardError(ValueError):
    """The model's layers are not of the shape the generic sharder splits; says which."""


class RowSharded(nn.Module):
    """A projection of which this rank holds some input features: its partial product, summed
    over the group, then the bias once."""

    def __init__(self, linear: nn.Module, group):
        super().__init__()
        self.bias = linear.pop("bias") if "bias" in linear else None
        self.linear = linear
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(self.linear(x), group=self.group)
        return y if self.bias is None else y + self.bias


def shard_model(model: nn.Module, layers: list[nn.Module], config: dict, group) -> None:
    """Keeps this rank's slice of every layer of `layers` (the model's own) in `model`."""
    if uses_model_shard(config, group.size()):
        model.shard(group)
        return
    for i, layer in enumerate(layers):
        if why := common_shape_refusal(layer):
            raise ShardError(f"layer {i} cannot be split by heads and width: {why}")
    for layer in layers:
        shard_layer(layer, group.size(), group.rank(), group)


def _out_features(linear: nn.Module) -> int:
    return linear["weight"].shape[0]


def common_shape_refusal(layer: nn.Module) -> str:
    """Why `layer` is not of the common decoder shape; "" when it is."""
    for name, projections in PROJECTIONS.items():
        part = layer.get(name)
        if not isinstance(part, nn.Module):
            return f"it has no {name}"
        for p in projections:
            if not isinstance(part.get(p), (nn.Linear, nn.QuantizedLinear)):
                return f"its {name} has no {p} linear projection"
    attn = layer["self_attn"]
    n_heads, n_kv = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    if not (isinstance(n_heads, int) and isinstance(n_kv, int) and n_kv and n_heads % n_kv == 0):
        return "its attention does not name its head counts n_heads and n_kv_heads"
    head_dim = _out_features(attn.q_proj) // n_heads
    if _out_features(attn.k_proj) != n_kv * head_dim:
        return f"its k_proj does not give {n_kv} heads of {head_dim}"
    # Anything else the attention holds must act on one head at a time (q/k norms).
    for key, value in attn.parameters().items():
        if key not in PROJECTIONS["self_attn"] and (
                not isinstance(value, dict) or any(
                    v.shape[-1:] != (head_dim,) for v in _arrays(value))):
            return f"its attention's {key} spans more than one head"
    extra = [k for k in layer["mlp"].parameters() if k not in PROJECTIONS["mlp"]]
    if extra:
        return f"its MLP holds {', '.join(extra)} besides gate/up/down"
    return ""


def _arrays(tree) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree
    return [a for v in items for a in _arrays(v)]


def _keep_rows(linear: nn.Module, rows: mx.array) -> None:
    """Keeps output features `rows` (in that order, repeats allowed)."""
    for key in ("weight", "scales", "biases", "bias"):
        if linear.get(key) is not None:
            linear[key] = mx.contiguous(mx.take(linear[key], rows, axis=0))


def _keep_columns(linear: nn.Module, start: int, end: int) -> nn.Module:
    """Keeps input features [start, end); a quantized one needs whole quantization groups."""
    if isinstance(linear, nn.QuantizedLinear):
        g, per = linear.group_size, 32 // linear.bits
        if start % g or end % g:
            raise ShardError(f"input features [{start}, {end}) do not fall on the "
                             f"quantization groups of {g}; dequantize the model or use a rank "
                             f"count that divides its heads and width")
        linear["weight"] = mx.contiguous(linear["weight"][:, start // per:end // per])
        for key in ("scales", "biases"):
            if linear.get(key) is not None:
                linear[key] = mx.contiguous(linear[key][:, start // g:end // g])
    else:
        linear["weight"] = mx.contiguous(linear["weight"][:, start:end])
    return linear


def _span(units: list[int] | range, size: int) -> mx.array:
    """Rows of the given units of `size` rows each (heads of head_dim), in order."""
    return mx.array([u * size + j for u in units for j in range(size)], dtype=mx.int32)


def shard_layer(layer: nn.Module, ranks: int, rank: int, group) -> None:
    """Keeps rank `rank`'s heads and MLP width of a layer of the common shape."""
    attn, mlp = layer["self_attn"], layer["mlp"]
    hs = head_slice(attn.n_heads, attn.n_kv_heads, ranks, rank)
    head_dim = _out_features(attn.q_proj) // attn.n_heads
    _keep_rows(attn.q_proj, _span(range(hs.q_start, hs.q_end), head_dim))
    for p in (attn.k_proj, attn.v_proj):
        _keep_rows(p, _span(list(hs.kv), head_dim))
    attn.o_proj = RowSharded(_keep_columns(
        attn.o_proj, hs.q_start * head_dim, hs.q_end * head_dim), group)
    attn.n_heads, attn.n_kv_heads = hs.q_end - hs.q_start, len(hs.kv)
    if hasattr(attn, "repeats"):  # Gemma's count of query heads a KV head
        attn.repeats = attn.n_heads // attn.n_kv_heads
    # The MLP's width in quantization groups where its down projection is quantized.
    unit = mlp.down_proj.group_size if isinstance(mlp.down_proj, nn.QuantizedLinear) else 1
    start, end = share(_out_features(mlp.gate_proj) // unit, ranks, rank)
    for p in (mlp.gate_proj, mlp.up_proj):
        _keep_rows(p, mx.arange(start * unit, end * unit))
    mlp.down_proj = RowSharded(_keep_columns(mlp.down_proj, start * unit, end * unit), group)
