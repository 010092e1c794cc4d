"""Whether a model can run as a tensor-parallel stage of N ranks, known without MLX.

A tensor-parallel stage runs mlx-lm's own `Model.shard(group)`: attention split by heads (q, k, v
column-sharded, o row-sharded), the MLP by its intermediate size, experts by theirs; embedding
and head stay whole on every rank. The coordinator decides before any weight moves, and imports
no MLX, so the families that have `shard()` are listed here (tests/test_tensor_split.py checks
the list against mlx-lm's classes) and the shape checks read config.json alone. The stage runner
(omlx_node/stage.py) checks the same when it loads.
"""

from __future__ import annotations

# mlx-lm 0.32's model modules whose Model has shard().
SHARDABLE = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41", "exaone_moe", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "iquestloopcoder", "kimi_k25", "kimi_k3",
    "llama", "longcat_flash", "longcat_flash_ngram", "minimax", "minimax_m3_vl", "ministral3",
    "mistral4", "muse_spark", "prism_hadamard_qwen35", "qwen2", "qwen3", "qwen3_5",
    "qwen3_5_moe", "qwen3_moe", "solar_open", "step3p5",
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


def _setting(config: dict, key: str):
    """A config value; multimodal configs keep the language model's under text_config."""
    value = config.get(key)
    return (config.get("text_config") or {}).get(key) if value is None else value


def tensor_refusal(config: dict, ranks: int) -> str:
    """Why the model of `config` (a config.json) cannot be a tensor-parallel stage of `ranks`
    ranks, with what to do instead; "" when it can."""
    model_type = str(config.get("model_type", ""))
    family = ALIASES.get(model_type, model_type)
    if ranks < 2:
        return f"a tensor-parallel stage needs at least 2 ranks, got {ranks}"
    if family not in SHARDABLE:
        return (f"model family {model_type!r} has no tensor-parallel split in mlx-lm "
                f"(no Model.shard()); serve it with --parallel pipeline")
    for key, what in DIVIDED:
        value = _setting(config, key)
        if isinstance(value, int) and value % ranks:
            return (f"{model_type} has {value} {what} ({key}), which do not divide over "
                    f"{ranks} ranks; use a rank count that divides it or --parallel pipeline")
    return ""
