"""`--node NAME=MEM[,...]` and sizes like `64GiB`, as `omlx-cluster plan` and the flags take
them: text into the planner's NodeSpec."""

from __future__ import annotations

import re

from omlx_coordinator.planning.planner import NodeSpec

_UNITS = {
    "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736; units B, KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal).
    A bare number is refused: 64 could mean bytes or GiB, and a wrong guess is a bad plan."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(
            f"memory size {text!r} is not a number with a unit, e.g. 64GiB, 96GB, 512MiB"
        )
    number, unit = m.groups()
    if unit.lower() not in _UNITS:
        raise ValueError(
            f"unknown unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        )
    return int(float(number) * _UNITS[unit.lower()])


def parse_node_arg(text: str) -> NodeSpec:
    """Parse `--node NAME=MEM[,speed=X][,link_ms=Y][,link_gbps=Z][,weights=SIZE]
    [,disk_gbps=W][,layer_ms=V]`, e.g. 'mac1=64GiB,speed=2.5,link_ms=0.6'.

    speed is in GB/s of weights streamed (see the module docstring), link_ms in milliseconds,
    link_gbps the link's bandwidth in GB/s; weights its --weights-memory (the rest of a stage
    streams from its SSD, read at disk_gbps GB/s); layer_ms a layer's fixed cost a decode step
    in milliseconds (what `join` measures beside the speed).
    """
    usage = ("expected NAME=MEM[,speed=X][,link_ms=Y][,link_gbps=Z][,weights=SIZE]"
             "[,disk_gbps=W][,layer_ms=V], e.g. mac1=64GiB,speed=2.5,link_ms=0.6")
    parts = [p.strip() for p in text.split(",")]
    name, sep, mem = parts[0].partition("=")
    name = name.strip()
    if not sep or not name or not mem.strip():
        raise ValueError(f"bad --node {text!r}: {usage}")
    try:
        memory = parse_size(mem)
    except ValueError as e:
        raise ValueError(f"bad --node {text!r}: {e}") from None
    options: dict[str, float | int] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        key = {"weights": "weights_cap"}.get(key.strip(), key.strip())
        if not sep or key not in ("speed", "link_ms", "link_gbps", "weights_cap", "disk_gbps",
                                  "layer_ms"):
            raise ValueError(f"bad --node {text!r}: unknown option {part!r}; {usage}")
        if key in options:
            raise ValueError(f"bad --node {text!r}: {key} given twice")
        try:
            options[key] = parse_size(value) if key == "weights_cap" else float(value)
        except ValueError:
            raise ValueError(f"bad --node {text!r}: {part!r} is not "
                             f"{'a size' if key == 'weights_cap' else 'a number'}") from None
    try:
        return NodeSpec(name=name, memory_bytes=memory, **options)
    except ValueError as e:
        raise ValueError(f"bad --node {text!r}: {e}") from None
