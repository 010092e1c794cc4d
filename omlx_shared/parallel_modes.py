"""The layouts a model can be spread over several nodes with (omlx_coordinator/planning/layout_choice.py
plans each): "pipeline" (each node a range of layers), "tensor" (each node a slice of every
layer), "tensor-pipeline" (runs of neighbouring nodes, each a tensor-parallel stage of a
pipeline: Thunderbolt islands chained over Ethernet) and "auto" (whichever the planner predicts
fastest). Here rather than in the coordinator so that the CLI's flags, the models config and the
planner name the same ones."""

from __future__ import annotations

PARALLEL = ("auto", "pipeline", "tensor", "tensor-pipeline")
