"""Prefix caches over synthetic and real KV, and what a stage computes with and without
them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from omlx_node.kv_cache import PrefixCache
from omlx_node.stage import StageRunner

BS = 16  # small blocks, so short prompts span several
BIG = 1 << 30
MODEL_ID = "tiny/llama-4l"


def rand_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def cold_logits(stage: StageRunner, prompt: list[int]) -> mx.array:
    kv = stage.make_cache()
    stage(mx.array([prompt[:-1]]), kv)
    return stage(mx.array([[prompt[-1]]]), kv)[0, -1]


def cached_logits(pc: PrefixCache, stage: StageRunner, prompt: list[int]) -> tuple[int, mx.array]:
    """What the batcher does: look up, restore, prefill the rest, store, run the last token.
    Returns (tokens restored, last logits)."""
    todo = prompt[:-1]
    n = pc.lookup(todo)
    kv = pc.restore(todo, n)
    done = kv[0].offset
    if done < len(todo):
        stage(mx.array([todo[done:]]), kv)
    mx.eval([c.state for c in kv])
    pc.store(todo, kv)
    return done, stage(mx.array([[prompt[-1]]]), kv)[0, -1]


def synthetic_cache(n_layers: int, tokens: int, seed: int, dtype=mx.float32) -> list[KVCache]:
    """KVCaches filled the way a prefill fills them (step-rounded buffers), random values."""
    caches = []
    for j in range(n_layers):
        key = mx.random.key(seed * 1000 + j)
        k1, k2 = mx.random.split(key)
        c = KVCache()
        c.update_and_fetch(
            mx.random.normal((1, 2, tokens, 8), key=k1).astype(dtype),
            mx.random.normal((1, 2, tokens, 8), key=k2).astype(dtype),
        )
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def make_pc(ssd_dir: Path | None, layers=(0, 4), **kw) -> PrefixCache:
    kw.setdefault("hot_max_bytes", BIG)
    kw.setdefault("ssd_max_bytes", BIG)
    return PrefixCache(kw.pop("model_id", MODEL_ID), layers, BS, ssd_dir=ssd_dir, **kw)


def files(pc: PrefixCache) -> list[Path]:
    return sorted(pc.dir.glob("*/*.safetensors")) if pc.dir.exists() else []


def metric(pc: PrefixCache, name: str, **labels) -> float:
    return pc.metrics.registry.get_sample_value(name, labels or None) or 0.0


