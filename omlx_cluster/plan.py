"""`plan`: how a model would be split over nodes, and why."""

from __future__ import annotations

import argparse
import sys


def plan_command(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from omlx_coordinator.planning.layout_choice import plan_layout
    from omlx_coordinator.planning.model_layout import read_layout
    from omlx_coordinator.planning.node_args import parse_node_arg
    from omlx_coordinator.planning.plan_table import format_plan
    from omlx_coordinator.planning.planner import PlanError
    from omlx_shared.model_spec import resolve_model
    from omlx_shared.model_store import ModelError

    try:
        path = resolve_model(args.model, progress=True)
        nodes = [replace(parse_node_arg(n), cache_bytes=args.hot_cache_max_size)
                 for n in args.node]
        plan = plan_layout(read_layout(path), nodes, args.parallel,
                           os_reserve_bytes=args.os_reserve, context_tokens=args.context,
                           max_sequences=args.sequences, split=args.split)
    except (ModelError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else format_plan(plan))
    return 0
