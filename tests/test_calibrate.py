"""A joining node measures its speed once (in a child process) and keeps the measurement."""

from __future__ import annotations

import pytest
import json

from omlx_node.calibrate import METHOD, node_speed
from omlx_shared.hardware import chip


@pytest.mark.slow
def test_speed_is_measured_once_and_kept(tmp_path):
    cache = tmp_path / "calibration.json"
    speed = node_speed(cache)
    assert speed > 0.01  # GB/s: even the slowest CPU streams more than 10 MB/s
    assert json.loads(cache.read_text()) == {"chip": chip(), "method": METHOD,
                                             "speed_gbps": speed}
    cache.write_text(json.dumps({"chip": chip(), "method": METHOD, "speed_gbps": 123.5}))
    assert node_speed(cache) == 123.5  # reused, not measured again
    assert node_speed(cache, recalibrate=True) not in (0.0, 123.5)


@pytest.mark.slow
def test_a_cache_of_another_machine_is_not_trusted(tmp_path):
    cache = tmp_path / "calibration.json"
    cache.write_text(json.dumps({"chip": "some other chip", "speed_gbps": 999.0}))
    assert node_speed(cache) != 999.0
    # Measured by an older method (x @ w, twice the rate nn.Linear reads at on a CPU).
    cache.write_text(json.dumps({"chip": chip(), "speed_gbps": 999.0}))
    assert node_speed(cache) != 999.0
    cache.write_text("not json")
    assert node_speed(cache) > 0
