"""omlx_node/stay_awake.py: the power assertion a node holds while a shard is loaded."""

from __future__ import annotations

import logging
import os
import sys

from omlx_node.stay_awake import StayAwake, caffeinate_command


def test_the_assertion_is_caffeinate_on_macos_and_nothing_elsewhere(caplog):
    if sys.platform == "darwin":
        assert caffeinate_command(123) == ["caffeinate", "-i", "-w", "123"]
        return
    assert caffeinate_command(os.getpid()) is None
    awake = StayAwake()
    with caplog.at_level(logging.INFO, logger="omlx_node.stay_awake"):
        awake.hold()
        awake.hold()
        awake.release()
    assert not awake.holding
    said = [r.message for r in caplog.records if "not macOS" in r.message]
    assert len(said) == 1  # said once, however many shards load


def test_hold_starts_one_process_and_release_stops_it():
    # The lifecycle with a stand-in for caffeinate that also waits until it is ended.
    awake = StayAwake([sys.executable, "-c", "import time; time.sleep(600)"])
    awake.hold()
    first = awake._process
    assert awake.holding
    awake.hold()  # a second shard loading: still the one assertion
    assert awake._process is first
    awake.release()
    assert not awake.holding and first.poll() is not None
    awake.release()  # nothing loaded twice: no error
