"""Private network namespaces for tests that send multicast (mDNS) or other test traffic.

Tests must never put packets on the machine's real interfaces. A namespace created here has only
its own loopback, brought up with multicast on and a route for 224.0.0.0/4, so mDNS between
processes inside it stays inside it.

    skip_unless_netns()
    with namespace("omlx-mdns") as ns:
        proc = netns_popen(ns, [sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        ...

Two namespaces joined by a veth pair (`link`) are two machines on one wire, and `shape` on that
wire drops or slows their packets: a partition, made and healed while processes run. A
thread of the test itself can talk into a namespace (`in_namespace`).

Needs root (CAP_SYS_ADMIN) and iproute2's `ip` (and `tc` for `shape`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Link:
    """A veth pair between two namespaces: `a_dev` in `a` holds `a_ip`, `b_dev` in `b` `b_ip`."""

    a: str
    a_dev: str
    a_ip: str
    b: str
    b_dev: str
    b_ip: str


def link(a: str, b: str, subnet: str = "10.231.0") -> Link:
    """Joins namespaces `a` and `b` with a veth pair, `SUBNET.1/30` on a's end and `.2` on b's.
    Both ends live inside the namespaces: deleting either namespace removes the pair."""
    tag = uuid.uuid4().hex[:6]
    lk = Link(a, f"va{tag}", f"{subnet}.1", b, f"vb{tag}", f"{subnet}.2")
    _ip("link", "add", lk.a_dev, "netns", a, "type", "veth", "peer", "name", lk.b_dev,
        "netns", b)
    for ns, dev, ip in ((a, lk.a_dev, lk.a_ip), (b, lk.b_dev, lk.b_ip)):
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{ip}/30", "dev", dev)
        _ip("netns", "exec", ns, "ip", "link", "set", dev, "up")
    return lk


def route(ns: str, dest: str, via: str) -> None:
    """In `ns`, packets for `dest` (an address or "default") go through `via`."""
    _ip("netns", "exec", ns, "ip", "route", "replace", dest, "via", via)


def forward(ns: str) -> None:
    """Lets `ns` route packets between its links (a switch between the other namespaces)."""
    netns_run(ns, ["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True,
              timeout=IP_TIMEOUT)


def shape(lk: Link, *spec: str) -> None:
    """Puts qdisc `SPEC` on both ends of the link, or takes it off (no spec). This kernel may
    lack netem and every tc filter; tbf is there: `CUT` drops every packet (none fits its
    bucket), `slow(rate)` queues them behind a rate."""
    for ns, dev in ((lk.a, lk.a_dev), (lk.b, lk.b_dev)):
        cmd = (["tc", "qdisc", "replace", "dev", dev, "root", *spec] if spec
               else ["tc", "qdisc", "del", "dev", dev, "root"])
        netns_run(ns, cmd, check=bool(spec), capture_output=True, timeout=IP_TIMEOUT)


# A token bucket smaller than any packet: everything is dropped, silently, as by a cable pulled
# out or a switch that stopped forwarding (no RST, no ICMP: TCP only times out).
CUT = ("tbf", "rate", "8bit", "burst", "10", "limit", "10")


def slow(rate: str, latency: str = "200ms") -> tuple[str, ...]:
    """A link of `rate` (tc units: "1mbit") whose queue holds `latency` worth of packets."""
    return ("tbf", "rate", rate, "burst", "1600", "latency", latency)


_CLONE_NEWNET = 0x40000000


def _enter(ns: str) -> None:
    """Moves the calling thread (only it: a network namespace is per thread) into `ns`."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


@contextmanager
def in_namespace(ns: str, threads: int = 4) -> Iterator[ThreadPoolExecutor]:
    """A thread pool whose threads live in namespace `ns`: sockets they open connect there (an
    HTTP client of a server inside it), the rest of the test stays outside."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=f"in-{ns}", initializer=_enter,
                              initargs=(ns,))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
