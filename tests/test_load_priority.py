"""A worker's load runs at nice 10 on a thread of its own (Linux), and the caller's priority,
on which the worker serves, is never lowered."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_node.load_priority import LOAD_NICE, at_low_priority, encode_nice, load_nice

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a nice value is a thread's only on Linux")


def nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_load_runs_niced_and_the_caller_keeps_its_priority(monkeypatch):
    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    mine = nice_of_this_thread()
    seen: dict[str, object] = {}

    def load() -> mx.array:
        seen["nice"] = nice_of_this_thread()
        seen["thread"] = threading.get_native_id()
        weights = mx.arange(1000, dtype=mx.float32) * 2
        mx.eval(weights)
        return weights

    weights = at_low_priority(load)
    assert seen["nice"] == max(mine, LOAD_NICE) and seen["thread"] != threading.get_native_id()
    assert nice_of_this_thread() == mine
    assert (weights + 1).sum().item() == sum(2 * i + 1 for i in range(1000))  # used here

    with pytest.raises(ValueError, match="no such weights"):
        at_low_priority(lambda: (_ for _ in ()).throw(ValueError("no such weights")))


def test_off_and_bad_settings(monkeypatch, caplog):
    monkeypatch.setenv("OMLX_LOAD_NICE", "0")
    assert load_nice() == 0
    here = threading.get_native_id()
    assert at_low_priority(threading.get_native_id) == here  # in place, as before
    assert at_low_priority(threading.get_native_id, elsewhere=False) == here
    monkeypatch.setenv("OMLX_LOAD_NICE", "7")
    assert load_nice() == 7
    monkeypatch.setenv("OMLX_LOAD_NICE", "low")
    assert load_nice() == LOAD_NICE and "OMLX_LOAD_NICE" in caplog.text
    monkeypatch.delenv("OMLX_ENCODE_NICE", raising=False)
    assert encode_nice() == 10
    seen = at_low_priority(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                           nice=encode_nice())
    assert seen == max(10, nice_of_this_thread())


def test_a_whole_process_lowered_threads_and_all():
    """What an encoder worker does at its start: every thread, those started before too."""
    import subprocess

    script = (
        "import os, threading, time\n"
        "from omlx_node.load_priority import lower_this_process\n"
        "stop = threading.Event()\n"
        "early = threading.Thread(target=stop.wait); early.start()\n"
        "lower_this_process(10)\n"
        "late = threading.Thread(target=stop.wait); late.start()\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(t))\n"
        "              for t in os.listdir('/proc/self/task')}))\n"
        "stop.set()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == f"[{max(10, nice_of_this_thread())}]", out.stderr


def test_models_loaded_there_run_here(tmp_path, monkeypatch):
    """A cross-encoder (a head beside mlx-embeddings' model) and Whisper (private position
    tables) loaded on the niced thread answer on this one, as when loaded here: nothing is left
    lazy on the loading thread's stream."""
    import numpy as np

    from omlx_node.encoders import Encoder
    from omlx_node.transcriber import Transcriber
    from tests.tiny_encoders import build_encoder, build_whisper, tone_wav

    monkeypatch.delenv("OMLX_LOAD_NICE", raising=False)
    ce = build_encoder(tmp_path / "ce", "xlm-roberta", classifier=True)
    ids = [[5, 6, 7, 8], [9, 10]]
    np.testing.assert_allclose(at_low_priority(lambda: Encoder(ce)).run(ids),
                               Encoder(ce).run(ids), atol=1e-6)
    whisper = build_whisper(tmp_path / "whisper")
    audio = tone_wav(1.0)
    there = at_low_priority(lambda: Transcriber(whisper)).run(audio, language="en",
                                                             temperature=0.0)
    assert there.text == Transcriber(whisper).run(audio, language="en", temperature=0.0).text
