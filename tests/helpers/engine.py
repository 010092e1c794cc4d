"""Driving a continuous batcher in process, and the mlx-lm generation its outputs must equal."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import Finish
from omlx_node.stage import StageRunner


def drain(batcher: Batcher, seqs, max_steps: int = 10_000) -> list[tuple[list[int], Finish]]:
    for _ in range(max_steps):
        if batcher.idle:
            break
        batcher.step()
    results = []
    for s in seqs:
        toks, fin = [], None
        while not s.events.empty():
            ev = s.events.get_nowait()
            if isinstance(ev, Finish):
                fin = ev
            else:
                toks.append(ev)
        results.append((toks, fin))
    return results


def reference(model, ids: list[int], n: int) -> list[int]:
    """mlx-lm's single-sequence greedy generation."""
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(tok))
    mx.synchronize()
    return out


def engine(path, cache: PrefixCache, chunk: int = 512) -> Batcher:
    return Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=chunk, prefix_cache=cache)


def reference_logprobs(model, ids: list[int], n: int, **penalties) -> list[tuple[int, mx.array]]:
    """mlx-lm's greedy tokens with the log-softmax vector each was chosen from."""
    out = [(int(t), lp) for t, lp in generate_step(
        mx.array(ids), model, max_tokens=n, logits_processors=make_logits_processors(**penalties))]
    mx.synchronize()
    return out


def assert_logprobs_match(got: list, ref: list[tuple[int, mx.array]], k: int) -> None:
    """`got`: (token, logprob, top ids, top logprobs) per token."""
    assert [g[0] for g in got] == [t for t, _ in ref]
    for (tok, lp, ids, lps), (_, vec) in zip(got, ref):
        assert lp == pytest.approx(vec[tok].item(), abs=1e-4)
        order = mx.argsort(-vec)[:k].tolist()
        assert list(ids) == order
        assert list(lps) == pytest.approx(vec[mx.array(order, dtype=mx.int32)].tolist(), abs=1e-4)
