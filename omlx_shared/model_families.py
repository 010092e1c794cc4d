"""Which mlx-lm model families a pipeline stage can run, known without MLX.

The coordinator plans before any node loads a weight, and it imports no MLX: a family that no
stage can serve must be refused there, with its name and the reason, not after the weights moved.
The node's stage runner (omlx_node/stage.py) checks the same table when it loads, and checks the
model's classes themselves (omlx_node/families.py) for families mlx-lm adds later.

Keyed by config.json's `model_type` (mlx-lm's aliases, such as kimi_k2 for deepseek_v3, need no
entry: they load the same classes).
"""

from __future__ import annotations

# model_type -> why a stage cannot run it: each departs from the shape every other family shares
# (an embedding, then decoder layers called as layer(h, mask, cache), then a final norm and a
# head). Checked against mlx-lm's classes (omlx_node/families.py finds the same at load).
_PER_LAYER_INPUTS = ("its layers take per-layer token embeddings computed from the prompt "
                     "before the first layer and share KV between layers, so a stage cannot "
                     "start from hidden states alone")
REFUSED = {
    "gemma3n": _PER_LAYER_INPUTS,
    "gemma4": _PER_LAYER_INPUTS,
    "gemma4_text": _PER_LAYER_INPUTS,
    "falcon_h1": "its layers take separate attention and Mamba masks "
                 "(layer(h, cache, attn_mask, mamba_mask))",
    "llama4": "its chunked-attention layers keep a ChunkedKVCache, whose mask a stage does "
              "not make",
    "rwkv7": "its layers hand each other a value (v_first) outside their caches",
    "plamo2": "its layers live inside a decoder module that runs them itself",
    "plamo3": "its layers live inside a decoder module that runs them itself",
    "iquestloopcoder": "it runs its layers in loops of its own",
    "nanochat": "its layers are not in an inner model a stage can slice",
    "talkie": "its layers are not in an inner model a stage can slice",
}


def refusal(config: dict) -> str | None:
    """Why no stage can serve the model of `config` (a config.json), or None."""
    model_type = str(config.get("model_type", ""))
    reason = REFUSED.get(model_type)
    return f"model family {model_type!r} cannot be served: {reason}" if reason else None
