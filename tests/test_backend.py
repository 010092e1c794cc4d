"""The data-plane backend: Thunderbolt port parsing, the pure chooser, and what a cluster does
with it on this Linux machine (no RDMA: ring, or a clear refusal for --backend jaccl)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omlx_coordinator.nodes.backend import BackendError, JacclFailures, choose_backend
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_node import thunderbolt
from proto import omlx_pb2 as pb
from tests.cluster_secret import SECRET
from tests.conftest import REPO, free_port, start_server
from tests.tiny_models import build_model, serving

# ---- recorded formats ------------------------------------------------------------------------
# The shapes of macOS 26's tool output (identifiers made up). This Mac ("mac-a") has three
# Thunderbolt 5 ports: receptacle 1 cabled straight to mac-b, receptacle 2 to a dock with a Mac
# behind it (RDMA does not cross the dock), receptacle 3 free.

MAC_A_PROFILE = {"SPThunderboltDataType": [
    {"_name": "thunderboltusb4_bus_0", "device_name_key": "Mac Studio",
     "domain_uuid_key": "aaaa0001-0000-4000-8000-000000000001",
     "receptacle_1_tag": {"current_speed_key": "Up to 120 Gb/s", "receptacle_id_key": "1",
                          "receptacle_status_key": "receptacle_connected"},
     "_items": [{"_name": "Mac Studio", "device_name_key": "Mac16,9",
                 "domain_uuid_key": "BBBB0002-0000-4000-8000-000000000002",
                 "vendor_name_key": "Apple Inc."}]},
    {"_name": "thunderboltusb4_bus_1", "device_name_key": "Mac Studio",
     "domain_uuid_key": "AAAA0002-0000-4000-8000-000000000002",
     "receptacle_1_tag": {"current_speed_key": "40 Gb/s", "receptacle_id_key": "2",
                          "receptacle_status_key": "receptacle_connected"},
     "_items": [{"_name": "Dock", "device_name_key": "Dock", "vendor_name_key": "Acme",
                 "_items": [{"_name": "MacBook Pro",
                             "domain_uuid_key": "CCCC0001-0000-4000-8000-000000000001"}]}]},
    {"_name": "thunderboltusb4_bus_2", "device_name_key": "Mac Studio",
     "domain_uuid_key": "AAAA0003-0000-4000-8000-000000000003",
     "receptacle_1_tag": {"current_speed_key": "Up to 120 Gb/s", "receptacle_id_key": "3",
                          "receptacle_status_key": "receptacle_no_devices_connected"}},
]}

MAC_A_HARDWARE_PORTS = """\
Hardware Port: Ethernet
Device: en0
Ethernet Address: 02:00:00:00:00:10

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 02:00:00:00:00:11

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 02:00:00:00:00:12

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 02:00:00:00:00:13

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 02:00:00:00:00:14

Hardware Port: Thunderbolt 3
Device: en4
Ethernet Address: 02:00:00:00:00:15

VLAN Configurations
===================
"""

MAC_A_IBV_DEVICES = """\
    device          \t   node GUID
    ------          \t----------------
    rdma_en2        \t0000000000000a01
    rdma_en3        \t0000000000000a02
    rdma_en4        \t0000000000000a03
"""

RDMA_DISABLED_IBV_DEVICES = """\
    device          \t   node GUID
    ------          \t----------------
"""


def test_parsers_read_the_recorded_formats():
    devices = thunderbolt.parse_ibv_devices(MAC_A_IBV_DEVICES)
    assert devices == {"rdma_en2", "rdma_en3", "rdma_en4"}
    hardware = thunderbolt.parse_hardware_ports(MAC_A_HARDWARE_PORTS)
    assert hardware["Thunderbolt 1"] == "en2" and hardware["Thunderbolt Bridge"] == "bridge0"
    ports = thunderbolt.parse_thunderbolt(MAC_A_PROFILE, hardware, devices)
    assert [(p.device, p.uuid, p.peer_uuid) for p in ports] == [
        ("rdma_en2", "AAAA0001-0000-4000-8000-000000000001",
         "BBBB0002-0000-4000-8000-000000000002"),  # upper-cased, as mac-b reports its own
        ("rdma_en3", "AAAA0002-0000-4000-8000-000000000002", ""),  # behind a dock
        ("rdma_en4", "AAAA0003-0000-4000-8000-000000000003", ""),  # no cable
    ]


def test_ports_without_rdma_are_left_out():
    hardware = thunderbolt.parse_hardware_ports(MAC_A_HARDWARE_PORTS)
    assert thunderbolt.parse_ibv_devices(RDMA_DISABLED_IBV_DEVICES) == set()
    assert thunderbolt.parse_thunderbolt(MAC_A_PROFILE, hardware, set()) == []
    only_one = thunderbolt.parse_thunderbolt(MAC_A_PROFILE, hardware, {"rdma_en2"})
    assert [p.device for p in only_one] == ["rdma_en2"]
    assert thunderbolt.parse_thunderbolt({}, hardware, {"rdma_en2"}) == []


def test_rdma_ports_is_empty_on_linux():
    assert sys.platform == "linux"
    assert thunderbolt.rdma_ports() == []


def test_rdma_ports_runs_the_mac_tools(monkeypatch):
    """The one place a fake stands in: the three tools of a Mac with Thunderbolt 5."""
    outputs = {"ibv_devices": MAC_A_IBV_DEVICES, "system_profiler": json.dumps(MAC_A_PROFILE),
               "networksetup": MAC_A_HARDWARE_PORTS}
    monkeypatch.setattr(thunderbolt.sys, "platform", "darwin")
    monkeypatch.setattr(thunderbolt, "_run", lambda *cmd: outputs[cmd[0]])
    assert [p.device for p in thunderbolt.rdma_ports()] == ["rdma_en2", "rdma_en3", "rdma_en4"]

    def missing(*cmd):
        if cmd[0] == "system_profiler":
            raise FileNotFoundError(cmd[0])
        return outputs[cmd[0]]

    monkeypatch.setattr(thunderbolt, "_run", missing)
    assert thunderbolt.rdma_ports() == []
    monkeypatch.setattr(thunderbolt, "_run", lambda *cmd: (
        RDMA_DISABLED_IBV_DEVICES if cmd[0] == "ibv_devices" else outputs[cmd[0]]))
    assert thunderbolt.rdma_ports() == []


# ---- the chooser -----------------------------------------------------------------------------


class Macs:
    """Synthetic Macs with Thunderbolt RDMA ports and the cables between them."""

    def __init__(self, *names: str, ports: int = 3):
        self.ports = {n: [pb.RdmaPort(device=f"rdma_en{i + 2}", uuid=f"{n}-port{i + 2}")
                          for i in range(ports)] for n in names}

    def cable(self, a: str, a_dev: str, b: str, b_dev: str, seen_by: str = "both") -> None:
        pa = next(p for p in self.ports[a] if p.device == a_dev)
        pb_ = next(p for p in self.ports[b] if p.device == b_dev)
        if seen_by in ("both", a):
            pa.peer_uuid = pb_.uuid
        if seen_by in ("both", b):
            pb_.peer_uuid = pa.uuid

    def choose(self, requested: str, *plan: str):
        return choose_backend(requested, [self.ports[n] for n in plan], list(plan))


def test_two_macs_one_cable():
    macs = Macs("mac-a", "mac-b")
    macs.cable("mac-a", "rdma_en3", "mac-b", "rdma_en2")
    choice = macs.choose("auto", "mac-a", "mac-b")
    assert choice.backend == "jaccl"
    assert choice.devices == [[None, "rdma_en3"], ["rdma_en2", None]]
    assert json.loads(choice.devices_json) == choice.devices
    assert "mac-a rdma_en3 <-> mac-b rdma_en2" in choice.reason


def test_two_cables_between_a_pair_keep_one_order_on_both_sides():
    macs = Macs("mac-a", "mac-b")
    macs.cable("mac-a", "rdma_en4", "mac-b", "rdma_en2")
    macs.cable("mac-a", "rdma_en2", "mac-b", "rdma_en4")
    choice = macs.choose("auto", "mac-a", "mac-b")
    # The k-th name of both rows is the same cable.
    assert choice.devices == [[None, ["rdma_en2", "rdma_en4"]], [["rdma_en4", "rdma_en2"], None]]
    # The same cables with the plan's ranks swapped.
    swapped = macs.choose("auto", "mac-b", "mac-a")
    assert swapped.devices == [[None, ["rdma_en2", "rdma_en4"]], [["rdma_en4", "rdma_en2"], None]]


def test_three_macs_in_a_ring():
    macs = Macs("a", "b", "c")
    macs.cable("a", "rdma_en2", "b", "rdma_en2")
    macs.cable("b", "rdma_en3", "c", "rdma_en2")
    macs.cable("c", "rdma_en3", "a", "rdma_en3")
    choice = macs.choose("auto", "a", "b", "c")
    assert choice.backend == "jaccl"
    assert choice.devices == [[None, "rdma_en2", "rdma_en3"],
                              ["rdma_en2", None, "rdma_en3"],
                              ["rdma_en3", "rdma_en2", None]]


def test_four_macs_need_only_the_ring_links():
    macs = Macs("a", "b", "c", "d")
    for (x, y) in [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]:
        macs.cable(x, "rdma_en2", y, "rdma_en3")
    choice = macs.choose("auto", "a", "b", "c", "d")
    assert choice.backend == "jaccl"
    assert choice.devices == [[None, "rdma_en2", None, "rdma_en3"],
                              ["rdma_en3", None, "rdma_en2", None],
                              [None, "rdma_en3", None, "rdma_en2"],
                              ["rdma_en2", None, "rdma_en3", None]]
    # The same cables in another rank order leave two ring links uncabled.
    other = macs.choose("auto", "a", "c", "b", "d")
    assert other.backend == "ring" and other.devices is None
    assert other.reason == ("no Thunderbolt cable between a and c; "
                            "no Thunderbolt cable between b and d")


def test_a_missing_cable_means_ring_and_says_which():
    macs = Macs("a", "b", "c", "d")
    for (x, y) in [("a", "b"), ("b", "c"), ("d", "a")]:
        macs.cable(x, "rdma_en2", y, "rdma_en3")
    choice = macs.choose("auto", "a", "b", "c", "d")
    assert (choice.backend, choice.reason) == ("ring", "no Thunderbolt cable between c and d")
    with pytest.raises(BackendError, match="no Thunderbolt cable between c and d"):
        macs.choose("jaccl", "a", "b", "c", "d")


def test_a_node_without_rdma_means_ring():
    macs = Macs("mac-a", "mac-b", "mac-c")
    macs.ports["mac-b"] = []
    macs.cable("mac-c", "rdma_en2", "mac-a", "rdma_en2")
    choice = macs.choose("auto", "mac-a", "mac-b", "mac-c")
    assert (choice.backend, choice.reason) == ("ring", "rank 1 (mac-b) has no RDMA device")
    nobody = Macs("local0", "local1", ports=0).choose("auto", "local0", "local1")
    assert nobody.backend == "ring"
    assert nobody.reason.startswith("no node of the plan has an RDMA device")


def test_a_cable_seen_from_one_end_counts():
    macs = Macs("mac-a", "mac-b")
    macs.cable("mac-a", "rdma_en2", "mac-b", "rdma_en4", seen_by="mac-b")
    assert macs.choose("auto", "mac-a", "mac-b").devices == [[None, "rdma_en2"],
                                                             ["rdma_en4", None]]


def test_requested_backends():
    macs = Macs("mac-a", "mac-b")
    macs.cable("mac-a", "rdma_en2", "mac-b", "rdma_en2")
    assert macs.choose("ring", "mac-a", "mac-b").backend == "ring"
    forced = macs.choose("jaccl", "mac-a", "mac-b")
    assert forced.backend == "jaccl" and forced.reason.startswith("--backend jaccl")
    assert macs.choose("jaccl", "mac-a").backend == "none"  # one stage: no data plane
    with pytest.raises(BackendError, match=r"rank 1 \(local1\) has no RDMA device"):
        choose_backend("jaccl", [macs.ports["mac-a"], []], ["mac-a", "local1"])
    with pytest.raises(ValueError, match="unknown backend"):
        macs.choose("mpi", "mac-a", "mac-b")


def test_a_jaccl_failure_holds_until_a_node_of_the_stage_is_admitted_again():
    failures = JacclFailures()
    failures.record([("mac-a", 1), ("mac-b", 1)], "no RDMA")
    assert failures.reason([("mac-a", 1), ("mac-b", 1)]) == "no RDMA"
    assert failures.reason([("mac-b", 1), ("mac-a", 1)]) is None  # another ring order
    assert failures.reason([("mac-a", 1), ("mac-b", 2)]) is None  # mac-b joined again
    assert failures.reason([("mac-a", 1), ("mac-b", 1)]) is None  # ... and the failure is gone


# ---- a cluster on this machine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("be") / "tiny-be", "llama", num_layers=4,
                       hidden_size=64, seed=3)


@pytest.mark.slow
def test_serve_auto_uses_ring_and_says_why(model, tmp_path):
    with start_server(model, "--nodes", "2", home=tmp_path / "home") as server:
        status = httpx.get(server.url + "/cluster/status", timeout=10).json()
        assert status["backend"]["name"] == "ring"
        assert status["backend"]["reason"].startswith("no node of the plan has an RDMA device")
        assert all(n["rdma_devices"] == [] for n in status["nodes"])
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": model.name, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        shown = subprocess.run([sys.executable, "-m", "omlx_cluster", "status", "--url",
                                server.url], capture_output=True, text=True, timeout=30)
        assert "data plane: ring (no node of the plan has an RDMA device" in shown.stdout
        assert "over ring (no node of the plan has an RDMA device" in server.log_tail(200)


@pytest.mark.slow
def test_serve_jaccl_refuses_without_rdma(model, tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "omlx_cluster", "serve", "--model", str(model), "--nodes",
         "2", "--backend", "jaccl", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "OMLX_CLUSTER_HOME": str(tmp_path / "home")})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("--backend jaccl needs a Thunderbolt RDMA cable on every ring link of the plan: "
            "no node of the plan has an RDMA device") in proc.stderr
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_jaccl_that_does_not_form_falls_back_to_ring(model):
    """Two local nodes made to look cabled (their handshake's ports are the only fake): the
    workers refuse jaccl at once (this MLX build has none), and the plan loads over ring."""

    async def main():
        manager = serving(model, "tiny-be", ClusterOptions(nodes=2, secret=SECRET))
        await manager.start()
        cluster = manager.main
        try:
            assert cluster.backend.backend == "ring"
            a, b = manager.cluster.members
            a.rdma_ports = [pb.RdmaPort(device="rdma_en2", uuid="A2", peer_uuid="B5")]
            b.rdma_ports = [pb.RdmaPort(device="rdma_en5", uuid="B5", peer_uuid="A2")]
            t0 = time.monotonic()
            await cluster.recover("test: cabled", always=True)
            fell_back = (cluster.ready, cluster.backend, time.monotonic() - t0)
            call = cluster.node.generate(pb.GenerateRequest(
                request_id="r", prompt_tokens=[5, 6, 7], max_tokens=3), timeout=60)
            tokens = [t async for chunk in call for t in chunk.tokens]
            # The same nodes again: ring at once, jaccl is not retried.
            await cluster.recover("test: again", always=True)
            return fell_back, tokens, cluster.backend
        finally:
            await manager.stop()

    (ready, choice, seconds), tokens, again = asyncio.run(main())
    assert ready and choice.backend == "ring"
    assert choice.reason.startswith("jaccl did not form: this MLX build has no jaccl backend "
                                    "on 127.0.0.1"), choice.reason
    assert "use --backend ring" in choice.reason
    assert seconds < 30  # both ranks refuse at once: no watchdog wait
    assert len(tokens) == 3
    assert again.backend == "ring" and again.reason.startswith(
        "jaccl did not form on these nodes before: this MLX build has no jaccl backend")
