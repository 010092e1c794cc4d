"""Bonjour discovery: NodeAnnouncement encoding, and real mDNS between processes.

The mDNS tests run every zeroconf process inside a private network namespace (tests/netns.py),
bound to its loopback: no packet reaches the machine's real interfaces.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from zeroconf import ServiceInfo

from omlx_shared.discovery import (
    SERVICE_TYPE,
    Advertiser,
    NodeAnnouncement,
    announce_address,
    default_interfaces,
)
from tests.netns import namespace, netns_popen, netns_run, skip_unless_netns

REPO = Path(__file__).resolve().parent.parent
SEEN_TIMEOUT = 10.0  # seconds for a browser to see an announcement or its goodbye
READY_TIMEOUT = 10.0  # seconds for a child to start zeroconf (an advertiser probes ~1-2 s)
EXIT_TIMEOUT = 5.0  # seconds for a child to exit after being told to


def _announcement(**kw: Any) -> NodeAnnouncement:
    base = dict(
        node_id="mac-studio-1",
        host="127.0.0.1",
        port=50051,
        version="0.1.0",
        memory_bytes=192 * 2**30,
        chip="Apple M2 Ultra",
        data_port=50061,
    )
    base.update(kw)
    return NodeAnnouncement(**base)


# --- pure unit tests (no network) -------------------------------------------------------------


def test_properties_round_trip() -> None:
    ann = _announcement()
    props = ann.to_properties()
    assert props == {
        "id": "mac-studio-1",
        "version": "0.1.0",
        "memory": str(192 * 2**30),
        "chip": "Apple M2 Ultra",
        "grpc_port": "50051",
        "data_port": "50061",
    }
    # ServiceInfo stores the TXT record as bytes, as it arrives off the wire.
    info = ServiceInfo(
        SERVICE_TYPE,
        f"{ann.node_id}.{SERVICE_TYPE}",
        port=ann.port,
        properties=props,
        server="omlx-mac-studio-1.local.",
        parsed_addresses=[ann.host],
    )
    assert all(isinstance(k, bytes) for k in info.properties)
    assert NodeAnnouncement.from_service_info(info) == ann


def test_from_service_info_defaults_and_defects() -> None:
    def info(props: dict, addresses: list[str] | None = None, port: int = 7000) -> ServiceInfo:
        return ServiceInfo(
            SERVICE_TYPE,
            f"x.{SERVICE_TYPE}",
            port=port,
            properties=props,
            server="omlx-x.local.",
            parsed_addresses=["10.0.0.7"] if addresses is None else addresses,
        )

    # data_port and chip are optional; the SRV port wins over the TXT copy.
    got = NodeAnnouncement.from_service_info(
        info({"id": "x", "version": "1", "memory": "1024", "grpc_port": "1"})
    )
    assert got == NodeAnnouncement("x", "10.0.0.7", 7000, "1", 1024, "", 0)
    # A foreign or broken record is one ValueError, never a KeyError deep in the browser.
    for props in ({"version": "1", "memory": "1"}, {"id": "x", "version": "1", "memory": "lots"}):
        with pytest.raises(ValueError):
            NodeAnnouncement.from_service_info(info(props))
    with pytest.raises(ValueError, match="IPv4"):
        NodeAnnouncement.from_service_info(info({"id": "x", "version": "1", "memory": "1"}, []))


def test_default_interfaces() -> None:
    assert default_interfaces("127.0.0.1") == ["127.0.0.1"]
    assert default_interfaces("localhost") == ["127.0.0.1"]
    assert default_interfaces("::1") == ["127.0.0.1"]
    assert default_interfaces("192.168.1.20") == ["192.168.1.20"]
    assert default_interfaces("0.0.0.0") is None
    assert default_interfaces("") is None


def test_a_host_name_is_announced_as_the_address_it_resolves_to(monkeypatch) -> None:
    """`join --host mac1.local`: peers get the address the name resolves to (here the
    machine's own name, from /etc/hosts); a name that does not resolve is a clear error."""
    name = socket.gethostname()
    address = socket.gethostbyname(name)
    assert announce_address(name) == address
    assert default_interfaces(name) == (["127.0.0.1"] if address.startswith("127.")
                                        else [address])

    def unresolvable(host: str) -> str:  # no DNS query leaves this machine
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    with pytest.raises(ValueError, match="cannot resolve the host 'mac1.local'.*LAN address"):
        announce_address("mac1.local")


def test_announce_address_specific_and_refusals() -> None:
    assert announce_address("192.168.1.20") == "192.168.1.20"
    assert announce_address("localhost") == "127.0.0.1"
    # 0.0.0.0 cannot be dialled: the advertiser refuses it before touching the network.
    with pytest.raises(ValueError, match="0.0.0.0"):
        Advertiser(_announcement(host="0.0.0.0"), interfaces=["127.0.0.1"])
    with pytest.raises(ValueError, match="IPv4"):
        Advertiser(_announcement(host="mac.local"), interfaces=["127.0.0.1"])
    with pytest.raises(ValueError, match="63"):
        Advertiser(_announcement(node_id="n" * 64), interfaces=["127.0.0.1"])


# --- real mDNS between processes, inside a private namespace ----------------------------------

# Child A: advertise one node on the namespace's loopback; print READY; close on SIGTERM or when
# stdin closes/says anything; print CLOSED. Lives at most 60 s on its own (a safety net).
ADVERTISER = r"""
import json, signal, sys, threading
from omlx_shared.discovery import Advertiser, NodeAnnouncement
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
adv = Advertiser(NodeAnnouncement(**json.loads(sys.argv[1])), interfaces=["127.0.0.1"])
print("READY", flush=True)
done.wait(60)
adv.close()
print("CLOSED", flush=True)
"""

# Child B: browse on the namespace's loopback the way the coordinator does: from an asyncio loop,
# callbacks hopping onto it with call_soon_threadsafe; print one JSON line per event. Stops when
# stdin closes or on SIGTERM; at most 60 s on its own.
BROWSER = r"""
import asyncio, dataclasses, json, signal, sys, threading
from omlx_shared.discovery import Browser

async def main():
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(done.set)),
                     daemon=True).start()
    def emit(obj):  # runs on the loop thread
        assert threading.current_thread() is threading.main_thread()
        print(json.dumps(obj), flush=True)
    def added(a):  # runs on zeroconf's thread: record which, then hop
        obj = {"event": "added", "thread": threading.current_thread().name, **dataclasses.asdict(a)}
        loop.call_soon_threadsafe(emit, obj)
    def removed(node_id):
        loop.call_soon_threadsafe(emit, {"event": "removed", "node_id": node_id})
    # Built straight on the loop thread: discovery must not attach zeroconf to this loop.
    b = Browser(on_added=added, on_removed=removed, interfaces=["127.0.0.1"])
    emit({"event": "ready"})
    try:
        await asyncio.wait_for(done.wait(), 60)
    except asyncio.TimeoutError:
        pass
    await asyncio.to_thread(b.close)

asyncio.run(main())
"""


def _pythonpath() -> str:
    # The repo first (children import the project from it), then whatever the caller had.
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


class Child:
    """A python child inside the namespace whose stdout lines are read with deadlines."""

    def __init__(self, ns: str, script: str, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=_pythonpath(), PYTHONUNBUFFERED="1")
        self.proc = netns_popen(
            ns,
            [sys.executable, "-c", script, *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # EOF

    def next_line(self, deadline: float) -> str:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            line = self.lines.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError from None
        if line is None:
            rc = self.proc.wait(EXIT_TIMEOUT)
            raise AssertionError(f"child exited early (rc={rc}): {self.stderr()}")
        return line

    def expect_line(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.next_line(deadline) == text:
                    return
            except TimeoutError:
                raise AssertionError(f"no {text!r} within {timeout} s: {self.stderr()}") from None

    def events(self, timeout: float) -> Iterator[dict]:
        """JSON events until the deadline (a TimeoutError ends the iteration with a failure)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.next_line(deadline)
            except TimeoutError:
                raise AssertionError(
                    f"expected event not seen within {timeout} s: {self.stderr()}"
                ) from None
            yield json.loads(line)

    def stderr(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(still running)"
        return self.proc.stderr.read()[-2000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


@pytest.fixture
def netns() -> Iterator[str]:
    skip_unless_netns()
    with namespace("omlx-mdns") as ns:
        yield ns


@pytest.fixture
def children(netns: str) -> Iterator[list[Child]]:
    # Depends on `netns` so that pytest kills the children before it deletes their namespace.
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:  # every child killed, also when the test failed
            child.kill()


PRINT_ANNOUNCE_ADDRESS = (
    "from omlx_shared.discovery import announce_address; print(announce_address('0.0.0.0'))"
)


@pytest.mark.slow
def test_netns_helper_isolates(netns: str) -> None:
    # Only loopback exists in the namespace, multicast routed to it: nothing can leave.
    links = netns_run(netns, ["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"]
    routes = netns_run(netns, ["ip", "route"], capture_output=True, text=True, check=True)
    assert "224.0.0.0/4 dev lo" in routes.stdout
    # announce_address("0.0.0.0") asks the routing table where multicast leaves (sends nothing).
    res = netns_run(
        netns,
        [sys.executable, "-c", PRINT_ANNOUNCE_ADDRESS],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=_pythonpath()),
        timeout=20,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "127.0.0.1"


@pytest.mark.slow
def test_browser_sees_advertisers_come_and_go(netns: str, children: list[Child]) -> None:
    early = _announcement(node_id="node-early", port=50051, data_port=50061)
    late = _announcement(
        node_id="node-late", port=50052, data_port=0, version="0.2.0", memory_bytes=64 * 2**30,
        chip="Apple M4 Pro",
    )

    def advertise(ann: NodeAnnouncement) -> Child:
        child = Child(netns, ADVERTISER, json.dumps(ann.__dict__))
        children.append(child)
        return child

    # One node already announced before the browser starts (found by the browser's query) ...
    a_early = advertise(early)
    a_early.expect_line("READY", READY_TIMEOUT)
    browser = Child(netns, BROWSER)
    children.append(browser)
    assert next(browser.events(READY_TIMEOUT)) == {"event": "ready"}
    # ... and one announced while it watches (found by the unsolicited announcement).
    a_late = advertise(late)

    seen: dict[str, dict] = {}
    for event in browser.events(SEEN_TIMEOUT):
        assert event["event"] == "added", event
        seen[event["node_id"]] = event
        if set(seen) == {"node-early", "node-late"}:
            break
    for ann in (early, late):
        got = dict(seen[ann.node_id])
        # Callbacks run on zeroconf's browser thread, not the main thread (documented contract).
        assert got.pop("event") == "added" and got.pop("thread") != "MainThread"
        assert got == ann.__dict__
    a_late.expect_line("READY", READY_TIMEOUT)

    # A graceful close (stdin) sends a goodbye: the browser drops the node at once, not at TTL.
    assert a_early.proc.stdin is not None
    a_early.proc.stdin.write("close\n")
    a_early.proc.stdin.flush()
    a_early.expect_line("CLOSED", EXIT_TIMEOUT)
    assert a_early.proc.wait(EXIT_TIMEOUT) == 0
    event = next(browser.events(SEEN_TIMEOUT))
    assert event == {"event": "removed", "node_id": "node-early"}

    # SIGTERM (how an agent is stopped) closes it the same way.
    a_late.proc.send_signal(signal.SIGTERM)
    a_late.expect_line("CLOSED", EXIT_TIMEOUT)
    assert a_late.proc.wait(EXIT_TIMEOUT) == 0
    event = next(browser.events(SEEN_TIMEOUT))
    assert event == {"event": "removed", "node_id": "node-late"}

    # The browser itself shuts down cleanly when asked.
    assert browser.proc.stdin is not None
    browser.proc.stdin.close()
    assert browser.proc.wait(EXIT_TIMEOUT) == 0, browser.stderr()


def test_default_node_ids_are_stable_and_unique_per_mac(tmp_path, monkeypatch) -> None:
    from omlx_shared.node_identity import default_node_id

    ids = []
    for mac in ("a", "b"):  # two Macs with one host name, each its own data folder
        monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path / mac))
        first = default_node_id()
        assert default_node_id() == first  # stable across restarts
        assert first.startswith(socket.gethostname().split(".")[0] + "-")
        assert (tmp_path / mac / "node-key").stat().st_mode & 0o077 == 0
        ids.append(first)
    assert ids[0] != ids[1]


@pytest.mark.slow
def test_two_nodes_with_one_name_both_announce(netns: str, children: list[Child]) -> None:
    """Two Macs given the same --name: the second is renamed on the wire, not a traceback."""
    same = _announcement(node_id="MacBook-Pro", port=50051, data_port=50061)
    for _ in range(2):
        child = Child(netns, ADVERTISER, json.dumps(same.__dict__))
        children.append(child)
        child.expect_line("READY", READY_TIMEOUT)
