"""This Mac's Thunderbolt ports that carry RDMA, and which port each one is cabled to.

The coordinator chooses MLX's jaccl backend for a plan only when every ring link of it is such a
cable (omlx_coordinator/nodes/backend.py). Three macOS tools describe the ports, read the way MLX's own
`mlx.distributed_config` reads them (mlx/_distributed_utils/config.py):

- `ibv_devices` lists the RDMA devices, named `rdma_<interface>` (RDMA over Thunderbolt 5, macOS
  26.2+, once enabled with `rdma_ctl enable` in macOS Recovery);
- `system_profiler SPThunderboltDataType -json` gives each port (receptacle) its own domain UUID
  and, under `_items`, the domain UUID of the Mac cabled to it;
- `networksetup -listallhardwareports` maps "Thunderbolt <receptacle>" to the interface (enX).

The parsers are pure; `rdma_ports` runs the tools, on macOS only.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_SECONDS = 20.0  # system_profiler takes a few seconds on a busy Mac


def parse_ibv_devices(text: str) -> set[str]:
    """The RDMA device names in `ibv_devices` output (a header, then one device per line)."""
    return {word for word in text.split() if word.startswith("rdma_")}


def parse_hardware_ports(text: str) -> dict[str, str]:
    """{"Thunderbolt 1": "en2", ...} from `networksetup -listallhardwareports`."""
    ports: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Hardware Port:"):
            name = line.removeprefix("Hardware Port:").strip()
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.removeprefix("Device:").strip()
            name = None
    return ports


def parse_thunderbolt(profile: dict, hardware_ports: dict[str, str],
                      rdma_devices: set[str]) -> list[pb.RdmaPort]:
    """The ports of `system_profiler SPThunderboltDataType -json` (parsed) that have an RDMA
    device, with the domain UUID of the port each is cabled to ("" when none is).

    Only a Mac cabled directly counts: one behind a dock or hub is nested deeper in `_items`,
    and RDMA does not cross the dock. UUIDs are upper-cased, so that both sides compare equal."""
    ports = []
    for bus in profile.get("SPThunderboltDataType", []):
        receptacle = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        iface = hardware_ports.get(f"Thunderbolt {receptacle}")
        if iface is None or f"rdma_{iface}" not in rdma_devices:
            continue
        peers = [item["domain_uuid_key"] for item in bus.get("_items", [])
                 if item.get("domain_uuid_key")]
        ports.append(pb.RdmaPort(device=f"rdma_{iface}",
                                 uuid=str(bus.get("domain_uuid_key", "")).upper(),
                                 peer_uuid=peers[0].upper() if peers else ""))
    return sorted(ports, key=lambda p: p.device)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True,
                          timeout=COMMAND_TIMEOUT_SECONDS).stdout


def rdma_ports() -> list[pb.RdmaPort]:
    """This machine's RDMA-capable Thunderbolt ports; [] off macOS, without RDMA, or when a tool
    is missing or fails (the cluster then uses the ring backend, so this is only logged)."""
    if sys.platform != "darwin":
        log.debug("no RDMA over Thunderbolt: not macOS")
        return []
    try:
        devices = parse_ibv_devices(_run("ibv_devices"))
        if not devices:
            log.debug("no RDMA device (RDMA over Thunderbolt is enabled with `rdma_ctl "
                      "enable` in macOS Recovery)")
            return []
        profile = json.loads(_run("system_profiler", "SPThunderboltDataType", "-json"))
        hardware = parse_hardware_ports(_run("networksetup", "-listallhardwareports"))
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log.debug("cannot list the Thunderbolt RDMA ports: %s", e)
        return []
    ports = parse_thunderbolt(profile, hardware, devices)
    log.debug("Thunderbolt RDMA ports: %s", ", ".join(
        f"{p.device} (cabled to {p.peer_uuid or 'nothing'})" for p in ports) or "none")
    return ports
