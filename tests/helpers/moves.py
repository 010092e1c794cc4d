"""What the logs say of a make-before-break move (omlx_coordinator/models/deployment.py
`_move`, `_retire`): the replaced plan's workers were unloaded after the switch, and on a
join's move the requests on it ran there to their end, none failed over and resumed."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.waiting import wait_for

RESUMED = "request lost its node"  # generation.py's line for a request that fails over
RETIRED = "the previous plan's"  # _retire's, once it unloaded the replaced plan's workers
DRAIN_SECONDS = 90.0  # MOVE_DRAIN_SECONDS and the unloads after it, with room


def assert_retired(coordinator_log: Path, nodes: list[str]) -> str:
    """The replaced plan's worker on each of `nodes` was unloaded after the switch; returns
    the line that says so."""
    line = wait_for(lambda: next((x for x in coordinator_log.read_text().splitlines()
                                  if RETIRED in x), None), DRAIN_SECONDS,
                    "the replaced plan's workers unloaded")
    assert f"unloaded on {', '.join(sorted(nodes))} (" in line, line
    return line


def assert_served_through(coordinator_log: Path, nodes: list[str]) -> None:
    """The replaced plan, on `nodes`, served its requests to their end, and its worker on each
    was unloaded; no request resumed."""
    assert "(its requests done)" in assert_retired(coordinator_log, nodes)
    resumed = [x for x in coordinator_log.read_text().splitlines() if RESUMED in x]
    assert not resumed, resumed
