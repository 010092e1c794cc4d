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


def paced(share: float, min_tokens: int, decode_s: float,
          passes: list[tuple[int, float]]) -> StepPace:
    """A pace that measured decode steps of `decode_s` and prefill passes of (tokens, seconds)."""
    pace = StepPace(share, min_tokens)
    pace.observe(decode_s, decoded=True, prefilled=0)
    for tokens, seconds in passes:
        pace.observe(seconds, decoded=False, prefilled=tokens)
    return pace


def test_while_others_decode_the_prefill_takes_share_steps() -> None:
    pace = StepPace(share=1.0, min_tokens=4)
    pace.observe(0.020, decoded=True, prefilled=0)  # a step: 20 ms
    pace.observe(0.020 + 100 * 0.001, decoded=True, prefilled=100)  # a token: 1 ms
    assert pace.budget(512, decoding=True) == 20
    assert paced(2.0, 4, 0.02, [(100, 0.1)]).budget(512, True) == 40
    assert paced(100.0, 4, 0.02, [(100, 0.1)]).budget(512, True) == 512


def test_a_token_that_costs_more_than_a_step_saves_up_for_the_floor() -> None:
    pace = paced(1.0, 4, 0.001, [(10, 0.1)])  # a step 1 ms, a token 10 ms
    budgets = [pace.budget(512, True) for _ in range(40)]
    assert budgets[:39] == [0] * 39 and budgets[39] == 4  # 40 steps' credit pays 4 tokens
    assert paced(1.0, 4, 0.001, [(10, 0.1)]).budget(3, True) == 0
    # A prompt with less left than the floor runs as soon as its tokens are paid for.
    pace = paced(1.0, 4, 0.001, [(10, 0.1)])
    assert [pace.budget(512, True, wanted=1) for _ in range(10)] == [0] * 9 + [1]


def test_a_pass_with_a_fixed_cost_runs_large_and_less_often() -> None:
    """On a GPU a pass of 27 tokens costs about what one of 1,000 does: the fit finds the fixed
    part, and the pace runs passes worth it instead of a few tokens every step."""
    per, fixed = 5e-6, 0.012
    passes = [(27, fixed + 27 * per), (700, fixed + 700 * per), (2048, fixed + 2048 * per)]
    pace = paced(1.0, 8, 0.020, passes)
    assert abs(pace.pass_s - fixed) < 1e-6 and abs(pace.token_s - per) < 1e-9
    # A pass of a whole chunk (22 ms) is the most its fixed part allows to be worth: a step
    # of 20 ms pays for one every other step, a step of 5 ms one every fifth step.
    pace = paced(1.0, 8, 0.020, passes)
    assert [pace.budget(2048, True, wanted=5000) for _ in range(2)] == [0, 2048]
    pace = paced(1.0, 8, 0.005, passes)
    assert [pace.budget(2048, True, wanted=5000) for _ in range(5)] == [0, 0, 0, 0, 2048]
    # The spent credit is the pass's measured time.
    pace.observe(0.005 + fixed + 2048 * per, decoded=True, prefilled=2048)
    assert pace.credit < 1e-9
    # A short remainder does not wait for a pass worth the fixed part: it is paid for at once.
    pace = paced(1.0, 8, 0.005, passes)
    assert [pace.budget(2048, True, wanted=27) for _ in range(3)] == [0, 0, 600]


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

    def budget(self, chunk: int, decoding: bool, wanted: int | None = None) -> int:
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
