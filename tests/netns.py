"""Private network namespaces for tests that send multicast (mDNS) or other test traffic.

Tests must never put packets on the machine's real interfaces. A namespace created here has only
its own loopback, brought up with multicast on and a route for 224.0.0.0/4, so mDNS between
processes inside it stays inside it.

    skip_unless_netns()
    with namespace("omlx-mdns") as ns:
        proc = netns_popen(ns, [sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        ...

Needs root (CAP_SYS_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import pytest

IP_TIMEOUT = 10.0  # seconds for one `ip` command; they take milliseconds

_probe_result: str | None = None  # "" when namespaces work, else why not (cached per process)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=check
    )


def _unique_name(prefix: str) -> str:
    # Linux caps names at 255 bytes, but keep it short and unique across parallel test runs.
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def netns_unavailable_reason() -> str | None:
    """None when this process can create network namespaces, else a human-readable reason."""
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe()
    return _probe_result or None


def _probe() -> str:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "creating a network namespace needs root"
    name = _unique_name("omlx-probe")
    try:
        res = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    if res.returncode != 0:
        return f"`ip netns add` is not permitted here: {res.stderr.strip() or res.returncode}"
    _ip("netns", "del", name, check=False)
    return ""


def skip_unless_netns() -> None:
    """Skip the calling test (with the reason) when network namespaces cannot be created."""
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"needs a private network namespace: {reason}")


@contextmanager
def namespace(name_prefix: str = "omlx-test") -> Iterator[str]:
    """Create a uniquely named netns with loopback up and multicast routed on it; yield its name.

    The namespace is deleted on exit, also when the body raises. Kill processes started in it
    before leaving the block: `ip netns del` only removes the name, and a process still inside
    keeps the namespace alive.
    """
    name = _unique_name(name_prefix)
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "multicast", "on")
        # Without this route a multicast send fails with ENETUNREACH: the namespace has no
        # default route, and loopback is the only device.
        _ip("netns", "exec", name, "ip", "route", "add", "224.0.0.0/4", "dev", "lo")
        yield name
    finally:
        _ip("netns", "del", name, check=False)


def _in_netns(ns: str, cmd: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def netns_popen(ns: str, cmd: Sequence[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen of `cmd` inside namespace `ns` (`ip netns exec` execs it: same pid)."""
    return subprocess.Popen(_in_netns(ns, cmd), **kw)


def netns_run(ns: str, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    """subprocess.run of `cmd` inside namespace `ns`; pass timeout= to bound it (default 30 s)."""
    kw.setdefault("timeout", 30.0)
    return subprocess.run(_in_netns(ns, cmd), **kw)
