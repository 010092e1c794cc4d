"""Whether a model can run as a tensor-parallel stage of N ranks, and how, known without MLX.

A tensor-parallel stage splits attention by heads (q, k, v column-sharded, o row-sharded) and the
MLP by its intermediate size (experts by theirs); embedding and head stay whole on every rank.
Two sharders do it (omlx_node/tensor_shard.py):

- mlx-lm's own `Model.shard(group)`, for the families that have one, where the rank count divides
  every size it splits (it splits evenly, and needs at least one KV head a rank);
- the generic sharder, for families of the common decoder shape (every layer a `self_attn` of
  q/k/v/o projections with per-head norms at most, and an `mlp` of gate/up/down projections, or
  an MoE block of SwitchGLU experts, dense shared experts and routers, split by width),
  with or without `shard()`: it gives each rank a contiguous run of KV heads with their query
  heads, ceil or floor of KV heads/ranks; with fewer KV heads than ranks, a run of query heads
  (ceil or floor of heads/ranks) with the KV heads they read (a KV head whose query heads
  straddle two ranks is held by both: a replica, as GQA allows, since a query head reads one KV
  head alone); and ceil or floor of the MLP's width. So 3 ranks serve a model of 32 heads and 8
  KV heads (12, 12 and 8 heads), or of 4 heads and 2 KV heads, and 4 ranks one of 1 KV head.

The coordinator decides before any weight moves, and imports no MLX, so the families are listed
here (tests/test_tensor_split.py checks the lists against mlx-lm's classes) and the checks read
config.json alone. The stage runner checks the same when it loads, and the generic sharder checks
every layer's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

# mlx-lm 0.32's model modules whose Model has shard().
SHARDABLE = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41", "exaone_moe", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "iquestloopcoder", "kimi_k25", "kimi_k3",
    "llama", "longcat_flash", "longcat_flash_ngram", "minimax", "minimax_m3_vl", "ministral3",
    "mistral4", "muse_spark", "prism_hadamard_qwen35", "qwen2", "qwen3", "qwen3_5",
    "qwen3_5_moe", "qwen3_moe", "solar_open", "step3p5",
})
# mlx-lm 0.32's model modules of the common decoder shape (the generic sharder's).
COMMON_SHAPE = frozenset({
    "cohere2", "ernie4_5", "exaone4", "gemma", "gemma2", "gemma3_text", "granite",
    "hunyuan_v1_dense", "llama", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss",
    "smollm3",
})
# config.json model types mlx-lm loads with another family's module (its MODEL_REMAPPING).
ALIASES = {"mistral": "llama", "kimi_k2": "deepseek_v3", "joyai_llm_flash": "deepseek_v3",
           "minimax_m2": "minimax", "iquestcoder": "llama", "xverse": "llama"}
# What shard() divides by the rank count, where the config has it.
DIVIDED = (("num_attention_heads", "attention heads"),
           ("num_key_value_heads", "KV heads"),
           ("intermediate_size", "MLP intermediate size"),
           ("moe_intermediate_size", "expert intermediate size"),
           ("shared_expert_intermediate_size", "shared expert intermediate size"))
# What the generic sharder splits, at least one a rank.
SPLIT = (("num_attention_heads", "attention heads"), ("intermediate_size", "MLP intermediate size"),
         ("moe_intermediate_size", "expert intermediate size"),
         ("shared_expert_intermediate_size", "shared expert intermediate size"))


@dataclass(frozen=True)
class HeadSlice:
    """One rank's share of a layer's attention: query heads [q_start, q_end), and the KV heads
    they read, in order."""
    q_start: int
    q_end: int
    kv: tuple[int, ...]


def share(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous run [start, end) of `size` units: the first size % ranks ranks
    one more than the others."""
    base, extra = divmod(size, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def head_slice(n_heads: int, n_kv_heads: int, ranks: int, rank: int) -> HeadSlice:
    """Rank `rank`'s query heads and the KV heads they read (GQA: query head h reads KV head
    h // (n_heads / n_kv_heads)).

    With at least as many KV heads as ranks, each rank gets whole groups (a KV head and its
    query heads), ceil or floor of n_kv_heads / ranks of them: nothing is held twice. With
    fewer, the query heads are split (ceil or floor of n_heads / ranks), and a KV head whose
    query heads straddle ranks is held by each; where a rank's run then reads its KV heads
    unevenly, each of its query heads gets its own copy of its KV head, so its attention stays a
    plain GQA of equal groups."""
    group = n_heads // n_kv_heads
    if n_kv_heads >= ranks:
        kv_start, kv_end = share(n_kv_heads, ranks, rank)
        return HeadSlice(kv_start * group, kv_end * group, tuple(range(kv_start, kv_end)))
    q_start, q_end = share(n_heads, ranks, rank)
    read = [h // group for h in range(q_start, q_end)]
    kv = sorted(set(read))
    if len({read.count(k) for k in kv}) > 1:
        return HeadSlice(q_start, q_end, tuple(read))
    return HeadSlice(q_start, q_end, tuple(kv))


def _setting(config: dict, key: str):
    """A config value; multimodal configs keep the language model's under text_config."""
    value = config.get(key)
    return (config.get("text_config") or {}).get(key) if value is None else value


def _family(config: dict) -> str:
    model_type = str(config.get("model_type", ""))
    return ALIASES.get(model_type, model_type)


def _undivided(config: dict, ranks: int) -> str:
    """Why mlx-lm's shard() cannot split this model evenly over `ranks`; "" when it can."""
    for key, what in DIVIDED:
        value = _setting(config, key)
        if isinstance(value, int) and value % ranks:
            return f"{value} {what} ({key}), which do not divide over {ranks} ranks"
    return ""


def uses_model_shard(config: dict, ranks: int) -> bool:
    """Whether the stage runs mlx-lm's own Model.shard() (else the generic sharder)."""
    return _family(config) in SHARDABLE and not _undivided(config, ranks)


def largest_share(config: dict, ranks: int) -> tuple[float, float]:
    """The largest fraction of a layer's weights, and of its KV, that one rank of `ranks`
    holds: 1/ranks where the split is even; more where it is not (rank 0's extra head) or KV
    heads are held twice. Counted whole for the weights: the largest of its attention's query
    share, KV share and MLP share (plan sizes need not be exact, only not short)."""
    even = 1 / ranks
    heads, kv = _setting(config, "num_attention_heads"), _setting(config, "num_key_value_heads")
    widths = [w for key, _ in SPLIT[1:] if isinstance(w := _setting(config, key), int) and w]
    if uses_model_shard(config, ranks) or not isinstance(heads, int):
        return even, even
    kv = kv if isinstance(kv, int) and kv else heads
    slices = [head_slice(heads, kv, ranks, r) for r in range(ranks)]
    q = max(s.q_end - s.q_start for s in slices) / heads
    kv_share = max(len(s.kv) for s in slices) / kv
    mlp = max((-(-w // ranks) / w for w in widths), default=even)
    return max(q, kv_share, mlp), kv_share


def quantization_group(config: dict) -> int:
    """The quantization group size of a quantized model's config (mlx's `quantization`, or
    Hugging Face's `quantization_config`); 0 for a model that is not quantized."""
    for key in ("quantization", "quantization_config"):
        q = _setting(config, key)
        if isinstance(q, dict) and isinstance(q.get("group_size"), int):
            return q["group_size"]
    return 0


def group_cut(config: dict, ranks: int) -> str:
    """Why a split over `ranks` would cut a quantized weight inside a quantization group, for
    ranks that keep the weights quantized (a GPU; a CPU dequantizes, omlx_node/stage.py); ""
    when it would not. The row-sharded projections (attention's o_proj over the query heads'
    features, the MLPs' down_proj over their width) split their input features, which each
    quantization group spans: every rank's run must start on a group."""
    g = quantization_group(config)
    heads = _setting(config, "num_attention_heads")
    if not g or not isinstance(heads, int) or not heads:
        return ""
    kv = _setting(config, "num_key_value_heads")
    kv = kv if isinstance(kv, int) and kv else heads
    head_dim = _setting(config, "head_dim") or (_setting(config, "hidden_size") or 0) // heads
    even = uses_model_shard(config, ranks)
    # (what is split, its size in features, each rank's first feature)
    splits = [("the attention output's input features (query heads x head_dim)",
               heads * head_dim,
               [share(heads, ranks, r)[0] * head_dim if even
                else head_slice(heads, kv, ranks, r).q_start * head_dim
                for r in range(ranks)])]
    for key, what in SPLIT[1:]:
        width = _setting(config, key)
        if not isinstance(width, int) or not width:
            continue
        if not even and key == "intermediate_size":
            # The generic sharder splits a dense MLP's width in whole groups already.
            starts = [share(width // g, ranks, r)[0] * g for r in range(ranks)]
            if width // g < ranks:
                return (f"its {what} ({key} {width}) is {width // g} quantization groups of "
                        f"{g}, fewer than the {ranks} ranks")
        else:
            starts = [share(width, ranks, r)[0] for r in range(ranks)]
        splits.append((f"the {what}", width, starts))
    for what, size, starts in splits:
        if cut := next((s for s in starts if s % g), None):
            return (f"a rank's share of {what} starts at feature {cut} of {size}, inside a "
                    f"quantization group of {g} (the model is quantized with group_size {g}); "
                    f"use a rank count whose shares fall on whole groups, a dequantized model, "
                    f"or --parallel pipeline")
    return ""


def tensor_refusal(config: dict, ranks: int) -> str:
    """Why the model of `config` (a config.json) cannot be a tensor-parallel stage of `ranks`
    ranks, with what to do instead; "" when it can."""
    model_type = str(config.get("model_type", ""))
    family = _family(config)
    if ranks < 2:
        return f"a tensor-parallel stage needs at least 2 ranks, got {ranks}"
    if uses_model_shard(config, ranks):
        return ""
    if family in COMMON_SHAPE:
        for key, what in SPLIT:
            value = _setting(config, key)
            if isinstance(value, int) and value < ranks:
                return (f"{model_type} has {value} {what} ({key}), fewer than the {ranks} "
                        f"ranks (each needs at least one); use at most {value} ranks or "
                        f"--parallel pipeline")
        return ""
    if family in SHARDABLE:
        return (f"{model_type} has {_undivided(config, ranks)}; mlx-lm's Model.shard() splits "
                f"evenly and {model_type} is not of the common decoder shape the uneven split "
                f"serves (its layers are not all attention q/k/v/o and a gate/up/down MLP or "
                f"SwitchGLU experts); use a rank count that divides it or --parallel pipeline")
    return (f"model family {model_type!r} has no tensor-parallel split: mlx-lm has no "
            f"Model.shard() for it and its layers are not of the common decoder shape the "
            f"generic sharder splits (attention q/k/v/o with per-head norms at most, a "
            f"gate/up/down MLP or SwitchGLU experts); serve it with --parallel pipeline")
