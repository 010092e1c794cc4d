"""A fresh worker's warm-up (omlx_node/warm_up.py) runs every stage's part of a first request on
every family shape the engine serves, first, middle and last stages alike, and leaves nothing
behind: the engine after it decodes exactly what mlx-lm does, and mx.random's key is where it
was."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm import load

from omlx_node.batcher import Batcher
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import random_key
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from omlx_node.warm_up import warm_up
from tests.helpers.engine import drain, reference
from tests.tiny_models import build_model

# Plain attention, sliding windows beside full layers, linear attention, MLA latents.
FAMILIES = ["llama", "gemma3_text", "qwen3_next", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_warms_up_and_leaves_no_trace(family, tmp_path, caplog):
    path = build_model(tmp_path / family, family, num_layers=4)
    caplog.set_level(logging.WARNING, logger="omlx_node.warm_up")
    for start, end in ((0, 1), (1, 3), (3, 4)):  # first, middle and last stage of a pipeline
        warm_up(StageRunner(path, start, end))
    whole = StageRunner(path)
    mx.random.seed(7)
    key = random_key().tolist()
    assert warm_up(whole) > 0
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert random_key().tolist() == key

    model, tok = load(str(path))
    batcher = Batcher(whole, NodeMetrics())
    prompts = [tok.encode(p) for p in ("The capital of France is", "def add(a, b):")]
    results = drain(batcher, [batcher.submit(SeqRequest(f"r{i}", p, 12))
                              for i, p in enumerate(prompts)])
    for (tokens, fin), p in zip(results, prompts):
        assert tokens == reference(model, p, 12) and fin.reason == "length"
