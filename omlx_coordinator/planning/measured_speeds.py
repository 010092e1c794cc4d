"""The speeds a model's nodes were measured at while it served, as its plans count them.

The rebalancer (omlx_coordinator/telemetry/rebalancer.py, mode auto) records them; the model's
re-plans after a loss or a join (omlx_coordinator/models/deployment.py) then split by what the
nodes did, not by their calibration: a node lost for its slowness must not come back with its
calibrated share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class MeasuredSpeeds:
    speeds: dict[str, float] = field(default_factory=dict)  # GB/s of weights, by node
    scale: float = 1.0  # measured / calibrated: puts the nodes never measured in the same units

    def record(self, speeds: Mapping[str, float], scale: float) -> None:
        self.speeds, self.scale = dict(speeds), scale

    def speed(self, node: str, calibrated: float) -> float:
        """The GB/s a plan counts `node` at: as measured, else its calibrated speed scaled."""
        return self.speeds.get(node) or calibrated * self.scale
