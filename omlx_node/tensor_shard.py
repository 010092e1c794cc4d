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
An MoE block of SwitchGLU experts (with shared experts or not) is split by width as qwen3_moe's
shard() does: every expert's slice, summed once after the block (`Summed`).

The head of a one-stage tensor-parallel layout (an untied linear one) is split by vocabulary
(`split_vocab`), which neither mlx-lm's shard() nor its peers do: each rank computes its run of
the logits and one all_gather gives every rank all of them. Whole, it is the largest single
read of a step that every rank would repeat: 13% of a 250M llama's weights, 26% of what each of
2 ranks reads a token. A logit is the same dot product of the same row either way.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from omlx_shared.tensor_split import head_slice, share, uses_model_shard

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# How the families' attention names its head counts: (query heads, KV heads).
HEAD_COUNTS = (("n_heads", "n_kv_heads"), ("num_heads", "num_key_value_heads"))
FEED_FORWARD = ("mlp", "block_sparse_moe")


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


class Summed(nn.Module):
    """An MoE block of which this rank holds every expert's slice of the width: its output,
    summed over the group. The router runs whole on every rank, on the same input, so every
    rank picks the same experts; the block's output is a weighted sum of its experts' (and
    shared experts') down projections, so the ranks' partial outputs add up to it."""

    def __init__(self, block: nn.Module, group):
        super().__init__()
        self.block = block
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.block(x), group=self.group)


class VocabSplit(nn.Module):
    """A head of which this rank holds rows [rank * per, (rank + 1) * per) of the vocabulary
    (zero rows past its end): its logits, gathered over the group in rank order."""

    def __init__(self, linear: nn.Module, group, vocab: int):
        super().__init__()
        self.linear = linear
        self.group = group
        self.vocab = vocab

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        # all_gather concatenates along the first axis: each rank's part goes as one row.
        parts = mx.distributed.all_gather(y.reshape(1, -1), group=self.group)
        parts = parts.reshape(self.group.size(), *y.shape)
        logits = mx.moveaxis(parts, 0, -2).reshape(*y.shape[:-1], -1)
        return logits[..., :self.vocab]


def split_vocab(lm: nn.Module, key: str, group) -> bool:
    """Splits `lm[key]`, an unbiased linear head, by vocabulary over `group` (VocabSplit);
    False (left whole) for any other head."""
    head = lm.get(key)
    if not _is_linear(head) or "bias" in head:
        return False
    vocab, n = _out_features(head), group.size()
    per = -(-vocab // n)
    start = min(vocab, group.rank() * per)
    end = min(vocab, start + per)
    for k in ("weight", "scales", "biases"):
        if head.get(k) is not None:
            rows = head[k][start:end]
            pad = mx.zeros((per - (end - start), *rows.shape[1:]), dtype=rows.dtype)
            head[k] = mx.contiguous(mx.concatenate([rows, pad]))
    lm[key] = VocabSplit(head, group, vocab)
    return True


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


def _head_counts(attn: nn.Module) -> tuple[str, str] | None:
    for names in HEAD_COUNTS:
        if all(isinstance(getattr(attn, n, None), int) for n in names):
            return names
    return None


def _feed_forward(layer: nn.Module) -> str | None:
    return next((n for n in FEED_FORWARD if isinstance(layer.get(n), nn.Module)), None)


def _is_linear(m) -> bool:
    return isinstance(m, (nn.Linear, nn.QuantizedLinear))


def _is_dense(m) -> bool:
    """A gate/up/down MLP and nothing else."""
    return (isinstance(m, nn.Module) and all(_is_linear(m.get(p)) for p in MLP)
            and set(m.parameters()) == set(MLP))


def _moe_refusal(block: nn.Module) -> str:
    """Why `block` is not an MoE block the generic sharder splits by width: SwitchGLU experts,
    dense shared experts and unbiased routers (any other linear) only."""
    experts = block.get("switch_mlp")
    if not isinstance(experts, SwitchGLU):
        return "its MLP is neither gate/up/down projections nor SwitchGLU experts (switch_mlp)"
    for p in MLP:
        proj = experts.get(p)
        if type(proj) is not SwitchLinear or "bias" in proj:
            return (f"its experts' {p} is not an unbiased, unquantized SwitchLinear (a "
                    f"quantized MoE is split on a CPU, which dequantizes it)")
    for key, child in block.items():
        if key == "switch_mlp" or _is_dense(child) or (_is_linear(child) and "bias" not in child):
            continue
        if isinstance(child, (nn.Module, mx.array)):
            return f"its MoE block holds {key}, neither experts, a shared MLP nor a router"
    return ""


def common_shape_refusal(layer: nn.Module) -> str:
    """Why `layer` is not of the common decoder shape; "" when it is."""
    attn = layer.get("self_attn")
    if not isinstance(attn, nn.Module):
        return "it has no self_attn"
    for p in ATTENTION:
        if not _is_linear(attn.get(p)):
            return f"its self_attn has no {p} linear projection"
    names = _head_counts(attn)
    if names is None:
        return "its attention does not name its head counts (n_heads and n_kv_heads)"
    n_heads, n_kv = (getattr(attn, n) for n in names)
    if not n_kv or n_heads % n_kv:
        return f"its {n_heads} query heads do not make groups of its {n_kv} KV heads"
    head_dim = _out_features(attn.q_proj) // n_heads
    if _out_features(attn.k_proj) != n_kv * head_dim:
        return f"its k_proj does not give {n_kv} heads of {head_dim}"
    # Anything else the attention holds must act on one head at a time (q/k norms).
    for key, value in attn.parameters().items():
        if key not in ATTENTION and (not isinstance(value, dict) or any(
                v.shape[-1:] != (head_dim,) for v in _arrays(value))):
            return f"its attention's {key} spans more than one head"
    ff = _feed_forward(layer)
    if ff is None:
        return "it has no mlp"
    return "" if _is_dense(layer[ff]) else _moe_refusal(layer[ff])


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


def _keep_width(mlp: nn.Module, start: int, end: int) -> None:
    """Keeps units [start, end) of a gate/up/down MLP's width; its down projection's partial
    sum is left for the caller to add up."""
    for p in (mlp.gate_proj, mlp.up_proj):
        _keep_rows(p, mx.arange(start, end))
    _keep_columns(mlp.down_proj, start, end)


def shard_layer(layer: nn.Module, ranks: int, rank: int, group) -> None:
    """Keeps rank `rank`'s heads and MLP width of a layer of the common shape."""
    attn = layer["self_attn"]
    heads_name, kv_name = _head_counts(attn)
    n_heads, n_kv = getattr(attn, heads_name), getattr(attn, kv_name)
    hs = head_slice(n_heads, n_kv, ranks, rank)
    head_dim = _out_features(attn.q_proj) // n_heads
    _keep_rows(attn.q_proj, _span(range(hs.q_start, hs.q_end), head_dim))
    for p in (attn.k_proj, attn.v_proj):
        _keep_rows(p, _span(list(hs.kv), head_dim))
    attn.o_proj = RowSharded(_keep_columns(
        attn.o_proj, hs.q_start * head_dim, hs.q_end * head_dim), group)
    setattr(attn, heads_name, hs.q_end - hs.q_start)
    setattr(attn, kv_name, len(hs.kv))
    if hasattr(attn, "repeats"):  # Gemma's count of query heads a KV head
        attn.repeats = (hs.q_end - hs.q_start) // len(hs.kv)
    name = _feed_forward(layer)
    ff = layer[name]
    if _is_dense(ff):
        # The width in quantization groups where the down projection is quantized.
        down = ff.down_proj
        unit = down.group_size if isinstance(down, nn.QuantizedLinear) else 1
        start, end = share(_out_features(ff.gate_proj) // unit, ranks, rank)
        _keep_width(ff, start * unit, end * unit)
        ff.down_proj = RowSharded(ff.down_proj, group)
        return
    experts = ff.switch_mlp
    start, end = share(experts.gate_proj.weight.shape[1], ranks, rank)
    for p in (experts.gate_proj, experts.up_proj):
        p.weight = mx.contiguous(p.weight[:, start:end, :])
    experts.down_proj.weight = mx.contiguous(experts.down_proj.weight[:, :, start:end])
    for child in ff.values():
        if _is_dense(child):  # a shared expert
            _keep_width(child, *share(_out_features(child.gate_proj), ranks, rank))
    layer[name] = Summed(ff, group)
