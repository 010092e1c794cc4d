"""Which mx.distributed backend a plan's data plane uses: jaccl (RDMA over Thunderbolt 5) when
every link the pipeline sends over is a Thunderbolt cable between RDMA ports, ring (TCP)
otherwise.

The pipeline only sends between ring neighbours (rank r to r + 1, the tail back to rank 0), so
MLX's ring variant of jaccl (MLX_JACCL_RING) needs a cable on those links only, not a full mesh.
Pure: no MLX, no I/O; the ports come from each node's handshake (omlx_node/thunderbolt.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from proto import omlx_pb2 as pb

BACKENDS = ("auto", "ring", "jaccl")
# MLX's jaccl ring opens at most this many connections towards each neighbour.
MAX_CABLES_PER_LINK = 4

# One entry of MLX's device matrix: no link, one device, or one device per cable.
DeviceEntry = str | list[str] | None


class BackendError(ValueError):
    """jaccl was asked for, but some ring link of the plan has no RDMA cable (the message names
    them)."""


@dataclass(frozen=True)
class BackendChoice:
    backend: str  # "ring", "jaccl", or "none" for a single stage (no data plane)
    reason: str  # for people: /cluster/status and the log
    # jaccl only: MLX_IBV_DEVICES, row r = rank r's device towards each rank (None: not linked)
    devices: list[list[DeviceEntry]] | None = None

    @property
    def devices_json(self) -> str:
        return json.dumps(self.devices) if self.devices is not None else ""


def _cables(a: Sequence[pb.RdmaPort], b: Sequence[pb.RdmaPort]) -> list[tuple[str, str]]:
    """(device on a's side, device on b's side) per cable between them, in a's device order.

    A cable seen from either end counts: the two Macs' profiles are read at different times.
    The k-th device on both sides must be the same cable, which this order gives both rows."""
    found: list[tuple[str, str]] = []
    for p in sorted(a, key=lambda p: p.device):
        for q in b:
            if q.device not in (theirs for _, theirs in found) and (
                    (p.peer_uuid and p.peer_uuid == q.uuid)
                    or (q.peer_uuid and q.peer_uuid == p.uuid)):
                found.append((p.device, q.device))
                break
    return found[:MAX_CABLES_PER_LINK]


def _entry(devices: list[str]) -> DeviceEntry:
    return devices[0] if len(devices) == 1 else devices


def choose_backend(requested: str, ranks_ports: Sequence[Sequence[pb.RdmaPort]],
                   names: Sequence[str]) -> BackendChoice:
    """The backend for a plan whose rank r runs on the node named `names[r]` with RDMA ports
    `ranks_ports[r]`. `requested` is "auto", "ring" or "jaccl"; jaccl that cannot be had raises
    BackendError naming what is missing."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    n = len(ranks_ports)
    if n < 2:
        return BackendChoice("none", "one stage: no data plane")
    if requested == "ring":
        return BackendChoice("ring", "--backend ring")

    missing = [f"rank {r} ({names[r]}) has no RDMA device" for r in range(n)
               if not ranks_ports[r]]
    if len(missing) == n:
        missing = ["no node of the plan has an RDMA device (RDMA over Thunderbolt 5, macOS 26.2+)"]
    devices: list[list[DeviceEntry]] = [[None] * n for _ in range(n)]
    links = []
    # With two ranks both ring links are the same pair of Macs.
    for r in range(n if n > 2 else 1):
        s = (r + 1) % n
        if not ranks_ports[r] or not ranks_ports[s]:
            continue
        cables = _cables(ranks_ports[r], ranks_ports[s])
        if not cables:
            missing.append(f"no Thunderbolt cable between {names[r]} and {names[s]}")
            continue
        devices[r][s] = _entry([mine for mine, _ in cables])
        devices[s][r] = _entry([theirs for _, theirs in cables])
        links.append(f"{names[r]} {'+'.join(m for m, _ in cables)} <-> "
                     f"{names[s]} {'+'.join(t for _, t in cables)}")

    if missing:
        if requested == "jaccl":
            raise BackendError("--backend jaccl needs a Thunderbolt RDMA cable on every ring "
                               "link of the plan: " + "; ".join(missing))
        return BackendChoice("ring", "; ".join(missing))
    how = "--backend jaccl" if requested == "jaccl" else "every ring link is a Thunderbolt cable"
    return BackendChoice("jaccl", f"{how}: {', '.join(links)}", devices)


class JacclFailures:
    """The stages whose automatic jaccl group failed to form, and why. Such a stage goes
    straight to ring while each of its nodes is on the admission it failed under: a node
    admitted again may come back with RDMA enabled, or recabled, and jaccl is tried again.
    A stage is given as (node name, times admitted) per rank."""

    def __init__(self) -> None:
        # The stage's names in rank order -> (their admission counts then, why it failed).
        self._failed: dict[tuple[str, ...], tuple[tuple[int, ...], str]] = {}

    def record(self, stage: Sequence[tuple[str, int]], error: str) -> None:
        names, admissions = zip(*stage)
        self._failed[names] = (admissions, error)

    def reason(self, stage: Sequence[tuple[str, int]]) -> str | None:
        """Why jaccl did not form on `stage` before (None: it may be tried)."""
        names, admissions = zip(*stage)
        failed = self._failed.get(names)
        if failed is None or failed[0] != admissions:
            self._failed.pop(names, None)
            return None
        return failed[1]
