"""How many micro-batches the pipeline head uses: as many as the device's cost curve pays for."""

from __future__ import annotations

import pytest

from omlx_node.calibrate import row_costs, step_cost
from omlx_node.pipeline import micro_batches_worth

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Weight-bandwidth bound (a GPU at tens of rows), compute bound, and bound until 64 rows.
FLAT = {r: 1.0 for r in ROWS}
LINEAR = {r: 0.01 * r for r in ROWS}
KNEE = {r: max(1.0, r / 64) for r in ROWS}


def test_cost_curve_is_interpolated_and_extrapolated():
    assert step_cost(LINEAR, 3) == pytest.approx(0.03)
    assert step_cost(LINEAR, 1024) == pytest.approx(10.24)
    assert step_cost(KNEE, 96) == pytest.approx(1.5)


@pytest.mark.parametrize("costs, rows, k_max, expected", [
    (FLAT, 32, 2, 1),      # two half batches cost two whole ones: lockstep
    (FLAT, 4096, 4, 1),
    (LINEAR, 32, 2, 2),    # cost grows with rows: one micro-batch per stage
    (LINEAR, 32, 4, 4),
    (LINEAR, 3, 4, 3),     # never more micro-batches than rows
    (LINEAR, 1, 4, 1),
    (KNEE, 32, 2, 1),      # below the knee splitting buys nothing...
    (KNEE, 256, 2, 2),     # ...above it, it does
    (KNEE, 256, 4, 4),
    (LINEAR, 32, 1, 1),    # K = 1 is lockstep whatever the curve
])
def test_micro_batches_follow_the_cost_curve(costs, rows, k_max, expected):
    assert micro_batches_worth(costs, rows, k_max) == expected


def test_row_costs_measures_every_row_count():
    import mlx.core as mx

    w = mx.random.normal((64, 256))
    costs = row_costs(lambda x: x @ w, 64, "float32", rows=(1, 8, 64), repeats=3)
    assert set(costs) == {1, 8, 64}
    assert all(c > 0 for c in costs.values())


def test_row_costs_stops_at_its_time_budget():
    import mlx.core as mx

    w = mx.random.normal((64, 64))
    costs = row_costs(lambda x: x @ w, 64, "float32", rows=(1, 2, 4, 8), budget_seconds=0.0)
    assert list(costs) == [1, 2]  # two points: a curve the head can still extrapolate
