"""A plan as text for `omlx-cluster plan`: a table of its stages, then its explanation."""

from __future__ import annotations

import io

from omlx_coordinator.planning.planner import Plan, human_bytes


def format_plan(plan: Plan) -> str:
    """The plan as text for `omlx-cluster plan`: a table of stages, then the explanation."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"Plan {plan.plan_hash} for {plan.model_id} ({plan.layout_name}): bottleneck "
              f"{plan.bottleneck_ms:.3f} ms",
        title_justify="left",
    )
    cache = any(st.cache_bytes for st in plan.stages)
    for col in ("stage", "node", "layers", "n", "weights", "KV", "prefix cache", "memory / budget",
                "est ms"):
        if col != "prefix cache" or cache:
            table.add_column(col, justify="left" if col in ("node", "layers") else "right")
    worst = plan.bottleneck_stage
    for s, st in enumerate(plan.stages):
        table.add_row(
            str(s),
            st.node,
            f"[{st.layer_start}, {st.layer_end})",
            str(st.num_layers),
            human_bytes(st.weight_bytes),
            human_bytes(st.kv_bytes),
            *([human_bytes(st.cache_bytes)] if cache else []),
            f"{human_bytes(st.memory_bytes)} / {human_bytes(max(st.memory_budget, 0))}",
            f"{st.est_ms:.3f}" + (" *" if s == worst else ""),
        )
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None, force_terminal=False).print(table)
    lines = [line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines()]
    lines += [line for line in plan.explanation if not line.startswith("Stage ")]
    return "\n".join(lines)
