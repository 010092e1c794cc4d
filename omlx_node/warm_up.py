"""A fresh shard worker's warm-up: what its first requests run, once, before it says it is ready.

MLX builds a kernel the first time a process runs it (on CUDA it compiles it, unless the
machine's kernel cache holds it already), so a fresh engine's first requests wait longer for
their first tokens than the ones after them, most of all on a GPU
(bench/results/first-request-cpu.md).
Unpaid at load, that lands on whoever sends the first request after a load, a re-plan or a
failover: an agent's next turn.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
from prometheus_client import CollectorRegistry

from omlx_node.stage_state import StageState
from omlx_node.metrics import StageProfile
from omlx_node.sampling import (
    RowSampler,
    SamplingParams,
    random_key,
    restore_random_key,
    sample_batch,
)
from omlx_node.stage import StageRunner

log = logging.getLogger(__name__)

PROMPT_TOKENS = 32
# The samplers of the warm-up's rows: greedy alone, then beside the most common sampled
# request (temperature and top-p, which ranks the whole vocabulary).
SAMPLERS = (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9))


def warm_up(stage: StageRunner) -> float:
    """Runs this stage's part of a first request and of a second one joining it, on throwaway
    caches: a prompt's prefill and a decode step of one row (plain KV caches), then a second
    prompt admitted and a step of two rows (batch caches), each step's tokens sampled on the
    last stage. Leaves nothing behind: no metric, no prefix-cache block, mx.random's key as it
    was, MLX's buffer cache emptied. A warm-up that fails is logged, not raised: the worker
    serves all the same. Returns the seconds it took."""
    t0 = time.perf_counter()
    key = random_key()
    state = StageState(stage, StageProfile(CollectorRegistry()))
    info, inputs = stage.info, stage.sample_input
    try:
        for seq in range(len(SAMPLERS)):
            state.prefill(seq, inputs(1, PROMPT_TOKENS))
            state.update(0, None, [seq])
            out = state.forward(0, inputs(seq + 1, 1))
            if info.is_last:
                out = sample_batch(out[:, -1, :], [RowSampler(p) for p in SAMPLERS[:seq + 1]])[0]
            mx.eval(out)
    except Exception:
        log.warning("the warm-up failed; the first requests compile what it would have",
                    exc_info=True)
    finally:
        restore_random_key(key)
        mx.clear_cache()
    return time.perf_counter() - t0
