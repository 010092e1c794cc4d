"""How a stage finds its parts in any mlx-lm model, and the few families that depart from the
common shape.

Every family mlx-lm runs as a decoder shares one shape, which the stage runner relies on:

    lm = the causal LM (the loaded model, or its `language_model` in a multimodal wrapper)
    inner = lm.model, with an embedding (embed_tokens, or as older families name it), layers
            and a final norm (norm, final_layernorm, ...)
    lm(tokens, cache) = head(inner.norm(layers(embed(tokens))))
    each layer is called as layer(h, mask, cache), its mask made from its own cache:
        KVCache (full attention, MLA too)   create_attention_mask(h, cache)
        RotatingKVCache (sliding window)    create_attention_mask(h, cache, window_size=...)
        ArraysCache (linear attention, SSM) create_ssm_mask(h, cache)

The embedding (with the family's own scaling, e.g. Gemma's sqrt(hidden)) and the head (tied or
not, with its own logit scaling or soft-capping) are run by the family's own code, not copied
here: `embedding_view` is the inner model with no layers and no norm, `head_view` the causal LM
with the inner model replaced by the hidden states. Only what a family computes differently
from that shape needs an entry in DEPARTURES; a family that mlx-lm adds later works unchanged
when it follows the shape, and `check_shape` names what differs when it does not.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
)


class FamilyError(ValueError):
    """The model's classes depart from the shape a stage runs; the message says how."""


@dataclass(frozen=True)
class Departure:
    """What one family computes differently from the common shape."""

    # Full-attention masks as boolean arrays, never "causal": MLA layers (DeepSeek V3, Kimi K2)
    # apply the mask to their positional scores themselves.
    mask_arrays: bool = False


# Keyed by the mlx-lm module that defines the inner model (so gemma3 shares gemma3_text's entry
# and kimi_k2, which loads deepseek_v3's classes, shares deepseek_v3's). The families whose own
# forward asks create_attention_mask for arrays (return_array=True): MLA adds the mask to its
# positional scores, Gemma 2 soft-caps its scores before masking them.
_MASK_ARRAYS = Departure(mask_arrays=True)
DEPARTURES: dict[str, Departure] = {
    family: _MASK_ARRAYS
    for family in ("deepseek_v3", "glm4_moe_lite", "gemma2", "kimi_linear", "kimi_k3",
                   "bailing_hybrid", "phi3small")
}

# What families name the inner model's embedding and final norm, most common first.
EMBED_NAMES = ("embed_tokens", "tok_embeddings", "embeddings", "wte", "embed_in")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_layer_norm")

# Cache classes by the mask their layers take: a batch cache takes the same as its single form.
_FULL = (KVCache, BatchKVCache)
_WINDOW = (RotatingKVCache, BatchRotatingKVCache)
_STATE = (ArraysCache,)


@dataclass(frozen=True)
class Anatomy:
    """Where a loaded model keeps the parts a stage runs."""

    family: str  # the mlx-lm module of the inner model, e.g. "gemma3_text"
    lm: nn.Module  # the causal LM: inner model + head
    inner: nn.Module  # embedding, layers, final norm
    lm_path: str  # parameter path of lm in the model: "" or "language_model"
    inner_key: str  # lm's attribute that holds inner
    embed_key: str  # inner's attribute that holds the embedding
    norm_key: str  # inner's attribute that holds the final norm

    @property
    def inner_path(self) -> str:
        return f"{self.lm_path}.{self.inner_key}" if self.lm_path else self.inner_key

    @property
    def departure(self) -> Departure:
        return DEPARTURES.get(self.family, Departure())

    def head_parts(self) -> list[str]:
        """The causal LM's own modules besides the inner model: its head (none when tied)."""
        return [k for k, v in self.lm.children().items()
                if k != self.inner_key and isinstance(v, nn.Module)]


def find_anatomy(model: nn.Module) -> Anatomy:
    """The causal LM and inner model of `model`; FamilyError naming what is missing."""
    for lm_path in ("", "language_model"):
        lm = model if not lm_path else model.get(lm_path)
        if isinstance(lm, nn.Module) and isinstance(lm.get("model"), nn.Module):
            inner = lm["model"]
            embed = next((k for k in EMBED_NAMES if k in inner), None)
            norm = next((k for k in NORM_NAMES if k in inner), None)
            missing = [what for what, found in (("embedding", embed), ("layers", "layers" in inner),
                                                ("final norm", norm)) if not found]
            if missing:
                raise FamilyError(
                    f"{type(inner).__module__}.{type(inner).__name__} has no "
                    f"{', '.join(missing)} a stage knows (embedding: {', '.join(EMBED_NAMES)}; "
                    f"final norm: {', '.join(NORM_NAMES)})")
            family = type(inner).__module__.rpartition(".")[2]
            if not isinstance(inner.layers, list):
                raise FamilyError(f"{family}: its layers are a {type(inner.layers).__name__}, "
                                  f"not a list a stage can slice")
            return Anatomy(family, lm, inner, lm_path, "model", embed, norm)
    raise FamilyError(f"{type(model).__module__}.{type(model).__name__} has no inner model "
                      f"(`model` or `language_model.model`) holding its layers")


def check_shape(anatomy: Anatomy, caches: list) -> None:
    """FamilyError unless every layer is called as layer(h, mask, cache) with a cache whose mask
    this module knows how to make."""
    for i, (layer, cache) in enumerate(zip(anatomy.inner.layers, caches)):
        if not callable(layer):
            raise FamilyError(f"{anatomy.family}: layer {i} ({type(layer).__name__}) is not "
                              f"callable: the family runs its layers its own way")
        params = list(inspect.signature(layer).parameters.values())
        required = [p.name for p in params[3:]
                    if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if (len(params) < 3 or required or "mask" not in params[1].name
                or "cache" not in params[2].name):
            names = ", ".join(p.name for p in params)
            raise FamilyError(f"{anatomy.family}: layer {i} is called as ({names}), not as "
                              f"(h, mask, cache), which is all a stage has to give it")
        if not isinstance(cache, _FULL + _WINDOW + _STATE):
            raise FamilyError(f"{anatomy.family}: layer {i} keeps a {type(cache).__name__}, "
                              f"for which a stage does not know the mask")


def layer_mask(h: mx.array, cache, departure: Departure):
    """The mask the family gives a layer with this cache, made as the family makes it."""
    if isinstance(cache, _STATE):
        return create_ssm_mask(h, cache)
    if isinstance(cache, _WINDOW):
        return create_attention_mask(h, cache, window_size=cache.max_size)
    return create_attention_mask(h, cache, return_array=departure.mask_arrays)


def mask_kind(cache) -> tuple[str, int]:
    """Layers whose caches have the same kind (and window) share one mask per step."""
    if isinstance(cache, _STATE):
        return "state", 0
    if isinstance(cache, _WINDOW):
        return "window", cache.max_size
    return "full", 0


class _Handed:
    """Stands for the inner model inside the causal LM's own head code: it returns the hidden
    states it is handed, and attribute reads (a tied embedding, args) go to the real one."""

    def __init__(self, inner: nn.Module):
        self._inner = inner

    def __call__(self, h: mx.array, *args, **kwargs) -> mx.array:
        return h

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def embedding_view(anatomy: Anatomy) -> nn.Module:
    """The inner model with no layers and an identity norm: called on token ids it runs the
    family's own embedding code (scaling, learned positions) and returns its output."""
    view = copy.copy(anatomy.inner)
    view.layers = []
    setattr(view, anatomy.norm_key, nn.Identity())
    return view


def head_view(anatomy: Anatomy) -> nn.Module:
    """The causal LM with its inner model replaced by `_Handed`: called on normed hidden states
    it runs the family's own head code (tied or not, logit scaling, soft-capping)."""
    view = copy.copy(anatomy.lm)
    setattr(view, anatomy.inner_key, _Handed(anatomy.inner))
    return view
