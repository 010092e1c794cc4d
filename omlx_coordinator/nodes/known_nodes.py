"""The nodes a coordinator had, kept across its restarts.

A coordinator that restarts (a crash, an upgrade) finds its nodes again as they register or
announce themselves, one by one, seconds apart. Planning the first model on whichever node
came first would load it there, then re-plan it over every node as the others arrive: a
reload of every stage, twice. So the coordinator writes down its members as they change, and
after a restart waits a bounded time for the ones it had before it plans. It writes down the
links it measured between them too: a restarted coordinator whose nodes are busy cannot always
probe them again at once, and a planner without their readings counts those links as free, so
it would plan otherwise than it did before the restart.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from omlx_shared.link_probe import LinkMeasurement
from omlx_shared.private_files import write_private

log = logging.getLogger(__name__)

# How long a restarted coordinator waits for its earlier members before it plans without the
# missing ones: nodes register every 2 s, and Bonjour answers within seconds.
REJOIN_SECONDS = 15.0
FILE_NAME = "cluster-nodes.json"


class KnownNodes:
    """The member names in `path` (JSON: {"nodes": [...], "links": [{"nodes": [a, b],
    "gb_per_s": ..., "latency_us": ..., "nbytes": ...}, ...]})."""

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def load(self) -> set[str]:
        """The names written last; none if there is no file or it cannot be read (a damaged
        file costs only the wait after a restart)."""
        names = self._read().get("nodes")
        return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()

    def load_links(self) -> dict[frozenset[str], LinkMeasurement]:
        """The links measured between those nodes, under each pair's names; a damaged entry
        is left out (it costs only a probe)."""
        links = {}
        for entry in self._read().get("links") or []:
            try:
                a, b = entry["nodes"]
                links[frozenset((str(a), str(b)))] = LinkMeasurement(
                    gb_per_s=float(entry["gb_per_s"]), latency_us=float(entry["latency_us"]),
                    nbytes=int(entry["nbytes"]))
            except (KeyError, TypeError, ValueError):
                continue
        return links

    def save(self, names: set[str],
             links: Mapping[frozenset[str], LinkMeasurement] | None = None) -> None:
        """Replaces the file atomically: a coordinator killed while writing keeps the old one."""
        pairs = [{"nodes": sorted(pair), **link.to_dict()}
                 for pair, link in sorted((links or {}).items(), key=lambda kv: sorted(kv[0]))
                 if pair <= names]
        try:
            write_private(self.path, json.dumps({"nodes": sorted(names), "links": pairs}))
        except OSError as e:
            log.warning("cannot remember the cluster's nodes in %s: %s", self.path, e)
