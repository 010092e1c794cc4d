"""A joining node measures its speed and a layer's fixed cost once (in a child process) and
keeps the measurement."""

from __future__ import annotations

import json
import math

import pytest

from omlx_node.calibrate import METHOD, Calibration, measure_layer_ms, node_calibration
from omlx_shared.blas import blas_env
from omlx_shared.hardware import chip

# What a shard worker preloads ("" where nothing): the calibration is measured with it.
BLAS = blas_env().get("LD_PRELOAD", "")


@pytest.mark.slow
def test_calibration_is_measured_once_and_kept(tmp_path):
    cache = tmp_path / "calibration.json"
    measured = node_calibration(cache)
    assert measured.speed_gbps > 0.01  # GB/s: even the slowest CPU streams more than 10 MB/s
    assert 0 < measured.layer_ms < 50
    assert json.loads(cache.read_text()) == {"chip": chip(), "method": METHOD, "blas": BLAS,
                                             "speed_gbps": measured.speed_gbps,
                                             "layer_ms": measured.layer_ms}
    cache.write_text(json.dumps({"chip": chip(), "method": METHOD, "blas": BLAS,
                                 "speed_gbps": 123.5, "layer_ms": 0.25}))
    assert node_calibration(cache) == Calibration(123.5, 0.25)  # reused, not measured again
    assert node_calibration(cache, recalibrate=True).speed_gbps not in (0.0, 123.5)


@pytest.mark.slow
def test_a_cache_of_another_machine_method_or_blas_is_not_trusted(tmp_path):
    cache = tmp_path / "calibration.json"
    cache.write_text(json.dumps({"chip": "some other chip", "method": METHOD, "blas": BLAS,
                                 "speed_gbps": 999.0, "layer_ms": 1.0}))
    assert node_calibration(cache).speed_gbps != 999.0
    # Measured with another BLAS than the workers run with (OpenBLAS installed since, say).
    cache.write_text(json.dumps({"chip": chip(), "method": METHOD, "blas": BLAS + "-other",
                                 "speed_gbps": 999.0, "layer_ms": 1.0}))
    assert node_calibration(cache).speed_gbps != 999.0
    # Measured by an older method (x @ w, twice the rate nn.Linear reads at on a CPU).
    cache.write_text(json.dumps({"chip": chip(), "speed_gbps": 999.0}))
    assert node_calibration(cache).speed_gbps != 999.0
    cache.write_text("not json")
    assert node_calibration(cache).speed_gbps > 0


def test_a_layer_costs_a_step_more_than_its_weights():
    """A real (tiny) layer's dispatch, norms and attention: a fraction of a millisecond or more
    on any CPU or GPU, far from zero and from a second."""
    ms = measure_layer_ms(seconds=0.4)
    assert math.isfinite(ms) and 0.005 < ms < 100


def test_a_calibration_times_the_nodes_own_work_not_the_machines_load():
    """On a CPU, time this process spends waiting (for a core other processes hold, here a
    sleep) is not the node's cost; time it computes is, on whichever clock reads less."""
    import time

    import mlx.core as mx

    from omlx_node.calibrate import Stopwatch

    if mx.default_device() != mx.cpu:
        pytest.skip("a GPU's calibration is timed on the wall clock")
    waiting = Stopwatch()
    time.sleep(0.3)
    assert waiting.wall() >= 0.3 and waiting.seconds() < 0.1
    working = Stopwatch()
    x = mx.random.normal((512, 512))
    while working.wall() < 0.3:
        mx.eval(x @ x)
    # Counted, though a busy shared machine may give it only part of a core meanwhile.
    assert 0.01 < working.seconds() <= working.wall()
