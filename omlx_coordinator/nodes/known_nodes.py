"""The nodes a coordinator had, kept across its restarts.

A coordinator that restarts (a crash, an upgrade) finds its nodes again as they register or
announce themselves, one by one, seconds apart. Planning the first model on whichever node
came first would load it there, then re-plan it over every node as the others arrive: a
reload of every stage, twice. So the coordinator writes down its members as they change, and
after a restart waits a bounded time for the ones it had before it plans.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omlx_shared.private_files import write_private

log = logging.getLogger(__name__)

# How long a restarted coordinator waits for its earlier members before it plans without the
# missing ones: nodes register every 2 s, and Bonjour answers within seconds.
REJOIN_SECONDS = 15.0
FILE_NAME = "cluster-nodes.json"


class KnownNodes:
    """The member names in `path` (JSON: {"nodes": [...]})."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> set[str]:
        """The names written last; none if there is no file or it cannot be read (a damaged
        file costs only the wait after a restart)."""
        try:
            names = json.loads(self.path.read_text())["nodes"]
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring %s: %s", self.path, e)
            return set()
        return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()

    def save(self, names: set[str]) -> None:
        """Replaces the file atomically: a coordinator killed while writing keeps the old one."""
        try:
            write_private(self.path, json.dumps({"nodes": sorted(names)}))
        except OSError as e:
            log.warning("cannot remember the cluster's nodes in %s: %s", self.path, e)
