"""Synthetic model layouts for the planner's pure-function tests."""

from __future__ import annotations

from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GiB

MiB = 1 << 20


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
