"""What the command line's flags take: argparse `type=` checks, each refusing a bad value with a
message that says what it must be."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def bounded(name: str, lo: float, hi: float, says: str, parse: Callable[[str], T] = float,
            open_lo: bool = False, open_hi: bool = False) -> Callable[[str], T]:
    """A `type=` taking `parse(value)` within lo..hi (an end left out where open_*), else
    refusing with `says` (formatted with the value as given and x as parsed; NaN is outside).
    `name` is what argparse calls it when `parse` raises ValueError ("invalid NAME value")."""

    def check(value: str) -> T:
        x = parse(value)
        if not ((lo < x if open_lo else lo <= x) and (x < hi if open_hi else x <= hi)):
            raise argparse.ArgumentTypeError(says.format(value=value, x=x))
        return x

    check.__name__ = name
    return check


def _port_number(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {value!r}") from None


def _finite_seconds(value: str) -> float:
    x = float(value)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {value!r}")
    return x


def size(value: str) -> int:
    """A memory size with a unit (64GiB, 512MiB), or 0."""
    from omlx_coordinator.planning.node_args import parse_size

    if value.strip() in ("0", "0B"):
        return 0
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


positive = bounded("_positive", 1, math.inf, "must be at least 1, got {x}", parse=int)
port = bounded("_port", 0, 65535, "a port is 0 to 65535, got {x}", parse=_port_number)
milliseconds = bounded("_milliseconds", 0, 1000, "must be 0 to 1000 milliseconds, got {value}")
share = bounded("_share", 0, 1, "must be between 0 and 1 (0.15 is 15%), got {x}",
                open_lo=True, open_hi=True)
share_or_all = bounded("_share_or_all", 0, 1,
                       "must be more than 0 and at most 1 (0.5 is half), got {x}", open_lo=True)
seconds = bounded("_seconds", 0, math.inf, "must be >= 0 seconds, got {x}",
                  parse=_finite_seconds)
positive_seconds = bounded("_positive_seconds", 0, math.inf, "must be more than 0 seconds",
                           parse=seconds, open_lo=True)
# The gateway's own limit (api/models.py).
unload_wait = bounded("_unload_wait", 0, 3600, "must be at most 3600 seconds, got {x:g}",
                      parse=seconds)
positive_size = bounded("_positive_size", 0, math.inf, "must be more than 0 bytes", parse=size,
                        open_lo=True)


def size_or_auto(value: str) -> int | None:
    return None if value.strip().lower() == "auto" else size(value)


def layer_counts(value: str) -> list[int]:
    """A split: layers per stage, e.g. 1,6,2."""
    try:
        parts = [int(p) for p in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 1,6,2, got {value!r}")
    if any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer: {value!r}")
    return parts


def host_port(value: str) -> str:
    """HOST:PORT ([v6]:PORT); an http:// in front is dropped (a gateway's URL, pasted)."""
    text = value.strip().removeprefix("http://").rstrip("/")
    host, sep, number = text.rpartition(":")
    if ("://" in text or not sep or not host or not number.isdigit()
            or not 0 < int(number) < 65536):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 192.168.1.20:8000), got "
                                         f"{value!r}")
    return text


def gateway_url(value: str) -> str:
    """A gateway's address: HOST:PORT is taken as http://HOST:PORT, and the base URL the SDK
    examples use (ending in /v1) as the gateway's own (the cluster routes are beside /v1)."""
    url = (value if "://" in value else "http://" + value).rstrip("/")
    return url.removesuffix("/v1")


def is_loopback(host: str) -> bool:
    """Whether a --host is reachable from this machine only (then a key or secret may lack)."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
