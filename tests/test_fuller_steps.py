"""On a stage that streams layers from disk, requests that arrive a little apart start together
(omlx_node/fuller_steps.py): one prefill and the same decode steps, so the streamed layers are
read once a step for all of them, with the tokens mlx-lm gives each alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load

from omlx_node.batcher import Batcher
from omlx_node.fuller_steps import MAX_WINDOW_S, gather_window, wait_left
from omlx_node.metrics import NodeMetrics
from omlx_node.sequence import Finish, SeqRequest
from omlx_node.stage import StageRunner
from tests.helpers.engine import reference
from tests.tiny_models import build_model

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 8, 11, 40, 2], [7, 6, 5, 4, 3, 2]]
TOKENS = 6
APART_S = 0.03  # between arrivals: longer than a pass of this tiny model's streamed layers
WINDOW_S = 0.5


def test_the_window_is_a_share_of_a_pass_and_bounded():
    assert gather_window(0.0) == 0.0  # a stage that streams nothing never waits
    assert gather_window(0.2, share=0.5) == pytest.approx(0.1)
    assert gather_window(60.0) == MAX_WINDOW_S  # a slow disk: the first request waits 1 s
    assert wait_left(0.1, now=10.04, oldest=10.0, new=2, room=8) == pytest.approx(0.06)
    assert wait_left(0.1, now=10.2, oldest=10.0, new=2, room=8) == 0.0  # it has passed
    assert wait_left(0.1, now=10.0, oldest=10.0, new=8, room=8) == 0.0  # the batch is full
    assert wait_left(0.0, now=10.0, oldest=10.0, new=1, room=8) == 0.0


def serve_staggered(batcher: Batcher) -> list:
    """The prompts submitted APART_S apart from another thread while this one runs the engine;
    returns their sequences once all have finished."""
    seqs: list = []

    def arrive() -> None:
        for p in PROMPTS:
            seqs.append(batcher.submit(SeqRequest(f"r{len(seqs)}", p, TOKENS)))
            time.sleep(APART_S)

    sender = threading.Thread(target=arrive)
    sender.start()
    deadline = time.monotonic() + 60
    while sender.is_alive() or not batcher.idle:
        assert time.monotonic() < deadline, "the engine did not finish the requests in 60 s"
        batcher.step(block=True)
    sender.join()
    return seqs


def events(seq) -> tuple[list[int], Finish | None]:
    out, fin = [], None
    while not seq.events.empty():
        ev = seq.events.get_nowait()
        out, fin = (out, ev) if isinstance(ev, Finish) else (out + [ev], fin)
    return out, fin


def test_requests_arriving_apart_start_and_step_together(tmp_path: Path):
    path = build_model(tmp_path / "m", num_layers=4)
    model, _ = load(str(path))
    want = [reference(model, p, TOKENS) for p in PROMPTS]
    stage = StageRunner(path, streamed=2)
    whole = StageRunner(path).nbytes() - stage.nbytes()  # what a pass reads
    mx.eval(stage(mx.array([PROMPTS[0]]), stage.make_cache()))  # a pass measured
    assert stage.streamed_seconds > 0

    passes = {}
    for name, window in (("alone", 0.0), ("together", WINDOW_S)):
        batcher = Batcher(stage, NodeMetrics(), speculative="off")
        # The share of a pass that makes the window WINDOW_S: this tiny model's pass is too
        # short to span the arrivals' spacing, which a real streamed layer's read would.
        batcher.gather_share = window / stage.streamed_seconds
        before = stage.streamed_bytes_read
        seqs = serve_staggered(batcher)
        passes[name] = (stage.streamed_bytes_read - before) / whole
        got = [events(s) for s in seqs]
        assert [t for t, _ in got] == want, name
        assert all(f is not None and f.reason == "length" for _, f in got), got
        firsts = {s.first_token_time for s in seqs}
        if name == "together":
            assert len(firsts) == 1, "their first tokens came from different steps"
        else:
            assert len(firsts) == len(PROMPTS)
    # Together: one prefill pass for the three prompts (all but their last tokens), one a
    # decode step, and the step scheduled before the last tokens were read: TOKENS + 2. Alone:
    # each prompt's prefill, and the steps the first ran before the others joined, are passes
    # of their own.
    assert passes["together"] <= TOKENS + 2, passes
    assert passes["alone"] >= passes["together"] + 4, passes
