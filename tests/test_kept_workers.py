"""The workers of a model's previous plan kept serving after a move (omlx_node/kept_workers.py):
one a model, taken back by pid, and stopped at their bound when no coordinator unloads them."""

from __future__ import annotations

import sys

from omlx_node.kept_workers import KeptWorkers
from omlx_shared.child import ChildProcess
from tests.helpers.waiting import wait_for


def sleeper() -> ChildProcess:
    return ChildProcess([sys.executable, "-c", "import time; time.sleep(60)"], "a kept worker")


def test_a_kept_worker_is_stopped_at_its_bound_unless_taken_back():
    stopped: list[int] = []
    kept = KeptWorkers(lambda p: (stopped.append(p.pid), p.stop(timeout=1.0)))
    bounded, taken = sleeper(), sleeper()
    try:
        assert kept.keep("m", bounded.pid, bounded, 9100, 0.5) == []
        assert kept.keep("other", taken.pid, taken, 0, 0.5) == []
        assert kept.holds_port(9100) and not kept.holds_port(9101)
        # The coordinator unloads this one in time: the bound passes it by.
        assert kept.take(taken.pid) is taken and kept.take(taken.pid) is None
        wait_for(lambda: not bounded.alive(), 10, "the kept worker stopped at its bound")
        assert stopped == [bounded.pid] and taken.alive()
        assert not kept.holds_port(9100)
    finally:
        for p in (bounded, taken):
            p.stop(timeout=1.0)


def test_one_worker_is_kept_a_model():
    kept = KeptWorkers(lambda p: p.stop(timeout=1.0))
    first, second, other = sleeper(), sleeper(), sleeper()
    try:
        kept.keep("m", first.pid, first, 0, 60)
        kept.keep("n", other.pid, other, 0, 60)
        # A second move of m before the first one's requests ended: the first is given back
        # to be stopped; n's stays.
        assert kept.keep("m", second.pid, second, 0, 60) == [first]
        assert kept.take_model("m") == [second] and kept.take_model("m") == []
        assert kept.take_all() == [other] and kept.take_all() == []
    finally:
        for p in (first, second, other):
            p.stop(timeout=1.0)
