"""A prompt that starts like one planned just ahead of it waits until that one is kept, then
restores all they share (omlx_node/prefill_order.py), with outputs still mlx-lm's."""

from __future__ import annotations

import pytest
from mlx_lm import load

from omlx_node.batcher import SeqRequest
from omlx_node.kv_cache import PrefixCache
from omlx_node.prefill_order import shared_start, waits_for_ahead
from tests.helpers.engine import drain, engine, reference
from tests.tiny_models import build_model


@pytest.mark.parametrize("a, b, n", [
    ([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 5, 3], 1),
    ([9] + [1] * 99, [1] * 100, 0), (list(range(1000)), list(range(999)) + [0], 999),
])
def test_shared_start(a, b, n) -> None:
    assert shared_start(a, b) == shared_start(b, a) == n


def test_a_prompt_waits_only_for_a_block_it_could_restore() -> None:
    shared = list(range(100, 120))  # 5 blocks of 4
    mine = shared + [1, 2, 3]
    assert waits_for_ahead(mine, [(shared + [7], 0)], 4)  # 5 blocks it would compute again
    assert waits_for_ahead(mine, [(shared + [7], 16)], 4)  # one of them not held yet
    assert not waits_for_ahead(mine, [(shared + [7], 20)], 4)  # held already: no wait
    assert not waits_for_ahead(mine, [(shared[:3] + [0] * 30, 0)], 4)  # less than a block
    assert not waits_for_ahead(mine, [], 4)


def test_a_session_started_alongside_restores_the_whole_shared_prompt(tmp_path) -> None:
    """Two sessions of one agent, their system prompt shared: both submitted together, one
    chunk would hold both prompts; the second waits for the first's prefill and restores all
    the blocks they share (before, it restored none and prefilled them again)."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, _ = load(str(path))
    vocab = model.args.vocab_size
    system = [(7 * j + 5) % (vocab - 10) + 10 for j in range(30)]
    prompts = [system + [11, 12, 13], system + [21, 22, 23, 24, 25]]
    with PrefixCache("tiny/llama", (0, 3), block_size=4) as cache:
        batcher = engine(path, cache)
        seqs = [batcher.submit(SeqRequest(str(i), p, 6)) for i, p in enumerate(prompts)]
        results = drain(batcher, seqs)
        assert [r[0] for r in results] == [reference(model, p, 6) for p in prompts]
        assert [s.cached for s in seqs] == [0, 28]
