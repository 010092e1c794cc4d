"""The prefill budget of an engine iteration (omlx_node.step_pace) and greedy outputs under it:
many sequences prefilling in pieces of every size while others decode, at different offsets,
some resuming from a cached prompt and answer, still give mlx-lm's tokens."""

from __future__ import annotations

import itertools

from mlx_lm import load

from omlx_node.batcher import Batcher
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import SeqRequest
from omlx_node.stage import StageRunner
from omlx_node.step_pace import StepPace
from tests.helpers.engine import drain, reference
from tests.tiny_models import build_model


def test_alone_a_prompt_gets_the_whole_chunk() -> None:
    pace = StepPace(share=1.0, min_tokens=16)
    assert pace.budget(512, decoding=True) == 512  # nothing measured yet
    pace.observe(0.010, decoded=True, prefilled=0)
    pace.observe(0.010 + 64 * 0.001, decoded=True, prefilled=64)
    assert pace.budget(512, decoding=False) == 512


def test_while_others_decode_the_prefill_takes_share_steps() -> None:
    pace = StepPace(share=1.0, min_tokens=4)
    pace.observe(0.020, decoded=True, prefilled=0)  # a step: 20 ms
    pace.observe(0.020 + 100 * 0.001, decoded=True, prefilled=100)  # a token: 1 ms
    assert pace.budget(512, decoding=True) == 20
    assert StepPace(2.0, 4, pace.decode_s, pace.token_s).budget(512, True) == 40
    assert StepPace(100.0, 4, pace.decode_s, pace.token_s).budget(512, True) == 512
    # A token that costs more than a step: the floor keeps the prompt moving.
    assert StepPace(1.0, 4, 0.001, 0.01).budget(512, True) == 4
    assert StepPace(1.0, 4, 0.001, 0.01).budget(3, True) == 3


def test_the_averages_follow_the_machine() -> None:
    pace = StepPace()
    for _ in range(30):
        pace.observe(0.050, decoded=True, prefilled=0)
    assert abs(pace.decode_s - 0.050) < 1e-3
    pace.observe(0.010, decoded=False, prefilled=10)
    assert pace.token_s == 0.001


class CyclingPace(StepPace):
    """Budgets of every size, the floor's and a chunk's included, whatever the timings."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes = itertools.cycle([1, 7, 3, 16, 2, 5])

    def budget(self, chunk: int, decoding: bool) -> int:
        return min(chunk, next(self._sizes)) if decoding else chunk


def test_greedy_outputs_stay_mlx_lms_under_small_budgets(tmp_path) -> None:
    """Sequences join at different steps with prompts of different lengths, prefill in budgets
    of 1 to 16 tokens while others decode, and second turns resume from their first turn's
    cached prompt and answer: every output is mlx-lm's."""
    path = build_model(tmp_path / "m", "llama", num_layers=3)
    model, tok = load(str(path))
    cache = PrefixCache("m", (0, 3), block_size=4, hot_max_bytes=1 << 30)
    batcher = Batcher(StageRunner(path), NodeMetrics(), prefill_chunk=24, prefix_cache=cache)
    batcher.pace = CyclingPace()
    base = tok.encode("An agent reads a file, then edits it, then runs the tests. " * 3)
    prompts = [base + tok.encode(f" Task {i}: " + "step " * (3 * i)) for i in range(6)]
    runs = []  # (sequence, its prompt, max_tokens)
    for i, p in enumerate(prompts):
        runs.append((batcher.submit(SeqRequest(f"t1-{i}", p, 6 + i)), p, 6 + i))
        for _ in range(3 + 2 * i):  # the others prefill and decode meanwhile
            batcher.step()
    answers = [toks for toks, _ in drain(batcher, [s for s, _, _ in runs])]
    for (_, p, n), got in zip(runs, answers):
        assert got == reference(model, p, n)
    # Second turns: turn 1's prompt and answer, re-sent, and something new.
    again = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        p2 = p + a + tok.encode(f" Result {i}.")
        again.append((batcher.submit(SeqRequest(f"t2-{i}", p2, 5)), p2))
        batcher.step()
    for (seq, p2), (toks, fin) in zip(again, drain(batcher, [s for s, _ in again])):
        assert toks == reference(model, p2, 5) and fin.reason == "length"
        assert seq.cached >= len(p2) - 1 - len(tok.encode(" Result 0.")) - 4
    cache.close()
