"""The order waiting prompts prefill in (omlx_node/prefill_order.py): shortest remaining first,
aged; a prompt that starts like one planned just ahead of it waits until that one is kept, then
restores all they share; outputs still mlx-lm's."""

from __future__ import annotations

import pytest
from mlx_lm import load

from omlx_node.kv_cache import PrefixCache
from omlx_node.prefill_order import priority, shared_start, waits_for_ahead
from omlx_node.sequence import SeqRequest
from tests.helpers.engine import drain, engine, reference
from tests.tiny_models import build_model


@pytest.mark.parametrize("a, b, n", [
    ([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 5, 3], 1),
    ([9] + [1] * 99, [1] * 100, 0), (list(range(1000)), list(range(999)) + [0], 999),
])
def test_shared_start(a, b, n) -> None:
    assert shared_start(a, b) == shared_start(b, a) == n


def test_the_shortest_goes_first_until_a_longer_one_has_waited_its_length() -> None:
    assert priority(300, 0.0, 0.001) < priority(1500, 0.0, 0.001)
    # 1,500 tokens at 1 ms: after 1.3 s of waiting it comes before a new 300-token prompt.
    assert priority(1500, 1.3, 0.001) < priority(300, 0.0, 0.001)
    assert priority(1500, 1.1, 0.001) > priority(300, 0.0, 0.001)
    assert priority(10, 5.0, 0.0) == 10  # nothing measured yet: by length alone


def test_short_turns_overtake_a_long_prompt_with_outputs_unchanged(tmp_path) -> None:
    """Many sequences prefilling and decoding together, at different offsets: a long new
    prompt, then later turns that restore their history and prefill a little, arriving while
    it and others prefill and decode. The short ones get their first token before the long
    one, and every output is mlx-lm's."""
    path = build_model(tmp_path / "m", "llama", num_layers=2)
    model, _ = load(str(path))
    vocab = model.args.vocab_size

    def words(seed: int, n: int) -> list[int]:
        return [(seed * 31 + 7 * j) % (vocab - 10) + 10 for j in range(n)]

    with PrefixCache("tiny/llama", (0, 2), block_size=4) as cache:
        batcher = engine(path, cache, chunk=16)
        batcher.shortest_first = True
        first = [words(i, 20 + 3 * i) for i in range(4)]
        runs = [(batcher.submit(SeqRequest(f"a{i}", p, 5)), p, 5) for i, p in enumerate(first)]
        answers = [t for t, _ in drain(batcher, [s for s, _, _ in runs])]
        for (_, p, n), got in zip(runs, answers):
            assert got == reference(model, p, n)
        decoding = [(batcher.submit(SeqRequest(f"d{i}", words(50 + i, 30), 40)),
                     words(50 + i, 30), 40) for i in range(2)]
        for _ in range(4):
            batcher.step()
        long = words(99, 200)
        late = [(batcher.submit(SeqRequest("long", long, 6)), long, 6)]
        batcher.step()
        for i, (p, a) in enumerate(zip(first, answers)):
            turn = p + a + words(70 + i, 5 + i)
            late.append((batcher.submit(SeqRequest(f"b{i}", turn, 6)), turn, 6))
            batcher.step()
        runs = decoding + late
        for (_, p, n), (got, fin) in zip(runs, drain(batcher, [s for s, _, _ in runs])):
            assert got == reference(model, p, n) and fin.reason == "length"
        assert all(s.cached >= len(p) - 12 for s, p, _ in late[1:])  # restored their history
        assert max(s.first_token_time for s, _, _ in late[1:]) < late[0][0].first_token_time


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
