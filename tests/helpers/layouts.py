"""Synthetic model layouts and clusters for the planner's pure-function tests."""

from __future__ import annotations

from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GiB, NodeSpec

MiB = 1 << 20

# Llama 3 8B's shape: what the tensor-parallel checks read (heads that divide, the family).
LLAMA_8B = (("model_type", "llama"), ("hidden_size", 4096), ("num_attention_heads", 32),
            ("num_key_value_heads", 8), ("intermediate_size", 14336))

SETTINGS = dict(os_reserve_bytes=4 * GiB, context_tokens=4096, max_sequences=4)


def uniform_layout(L: int = 32, layer: int = 1 * GiB, tied: bool = False) -> ModelLayout:
    """L layers of `layer` bytes, a 512 MiB embedding and (untied) head, a 16 KiB norm."""
    return ModelLayout(
        model_id="uniform",
        num_layers=L,
        layer_bytes=(layer,) * L,
        embed_bytes=512 * MiB,
        head_bytes=0 if tied else 512 * MiB,
        norm_bytes=16 * 1024,
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=4096,
    )


def layout(layer_gib: float = 0.5, layers: int = 32, shape=LLAMA_8B) -> ModelLayout:
    """A model "m" of `layers` equal layers with a 512 MiB embedding and head, of `shape`."""
    return ModelLayout("m", layers, (int(layer_gib * GiB),) * layers, embed_bytes=1 << 29,
                       head_bytes=1 << 29, norm_bytes=1 << 13, tied_embeddings=False,
                       kv_bytes_per_token_per_layer=1 << 12, shape=shape)


def macs(n: int, memory_gib: int, link_ms: float, speed: float = 400.0) -> list[NodeSpec]:
    """n equal nodes mac0.. of `memory_gib` GiB, over links of `link_ms` and 5 Gbit/s."""
    return [NodeSpec(f"mac{i}", memory_gib * GiB, speed=speed, link_ms=link_ms,
                     link_gbps=5.0) for i in range(n)]
