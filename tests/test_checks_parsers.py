"""The pure parsers and judgements of omlx_shared/checks.py (and doctor's), on examples written
in the formats the macOS tools document and print: `sw_vers`, `sysctl`, `pmset -g` /
`pmset -g custom`, `system_profiler SPThunderboltDataType -json`, `rdma_ctl status`,
`ibv_devices` / `ibv_devinfo` (Apple TN3205's examples), `df -Pk`, `socketfilterfw`."""

from __future__ import annotations

import json

from omlx_cluster.doctor import judge_clock, judge_link, judge_ports, judge_versions
from omlx_shared import checks
from omlx_shared.checks import FAIL, GIB, PASS, WARN, Context, Output

MAC = Context(system="Darwin")

SW_VERS = "ProductName:\t\tmacOS\nProductVersion:\t\t26.2\nBuildVersion:\t\t25C56\n"
SW_VERS_OLD = "ProductName:\t\tmacOS\nProductVersion:\t\t15.6.1\nBuildVersion:\t\t24G90\n"

SYSCTL = "machdep.cpu.brand_string: Apple M4 Max\nhw.memsize: 137438953472\n"
SYSCTL_WIRED = "iogpu.wired_limit_mb: 0\nhw.memsize: 68719476736\n"

# A Mac mini on power: `pmset -g` (what is in use), then `pmset -g custom` (per source).
PMSET_MINI = """System-wide power settings:
Currently in use:
 standby              0
 Sleep On Power Button 1
 autorestart          0
 hibernatefile        /var/vm/sleepimage
 powernap             1
 networkoversleep     0
 disksleep            10
 sleep                1 (sleep prevented by powerd, caffeinate)
 hibernatemode        0
 ttyskeepawake        1
 displaysleep         10
 tcpkeepalive         1
 womp                 1
"""
PMSET_CUSTOM_MINI = """AC Power:
 Sleep On Power Button 1
 autorestart          0
 hibernatefile        /var/vm/sleepimage
 powernap             1
 disksleep            10
 sleep                1
 displaysleep         10
 womp                 1
"""
PMSET_CUSTOM_LAPTOP = """Battery Power:
 lidwake              1
 standby              1
 hibernatefile        /var/vm/sleepimage
 powernap             0
 disksleep            10
 sleep                5
 displaysleep         2
 lowpowermode         0
AC Power:
 lidwake              1
 standby              1
 powernap             1
 disksleep            10
 sleep                0
 displaysleep         10
 lowpowermode         0
"""
PMSET_DISABLED = ("System-wide power settings:\n SleepDisabled\t\t1\n"
                  "Currently in use:\n sleep                0\n")


def thunderbolt_bus(receptacle: str, speed: str, status: str, items: list | None = None) -> dict:
    bus = {"_name": f"thunderboltusb4_bus_{int(receptacle) - 1}",
           "device_name_key": "Mac mini", "domain_uuid_key": f"0000000{receptacle}-AAAA-BBBB",
           "receptacle_1_tag": {"current_speed_key": speed, "link_status_key": "0x2",
                                "receptacle_id_key": receptacle,
                                "receptacle_status_key": status},
           "route_string_key": "0", "vendor_name_key": "Apple Inc."}
    if items is not None:
        bus["_items"] = items
    return bus


STUDIO = {"_name": "Mac Studio", "device_name_key": "Mac16,9", "domain_uuid_key": "D00D-1",
          "vendor_name_key": "Apple Inc."}
DRIVE = {"_name": "Thunderbolt SSD", "device_name_key": "TB SSD", "mode_key": "usb_four",
         "vendor_name_key": "Other World Computing"}  # no domain of its own: not a Mac
PROFILE = {"SPThunderboltDataType": [
    thunderbolt_bus("1", "80 Gb/s", "receptacle_connected", [STUDIO]),
    thunderbolt_bus("2", "Up to 120 Gb/s", "receptacle_no_devices_connected"),
    thunderbolt_bus("3", "40 Gb/s", "receptacle_connected", [DRIVE]),
]}

IBV_DEVICES = """    device          \t   node GUID
    ------          \t----------------
    rdma_en2        \te0c5797d9c8fac05
    rdma_en3        \te1c5797d9c8fac05
"""
IBV_DEVINFO = """hca_id:\trdma_en2
\ttransport:\t\t\tThunderbolt (100)
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_ACTIVE (4)
\t\t\tmax_mtu:\t\t4096 (5)

hca_id:\trdma_en3
\ttransport:\t\t\tThunderbolt (100)
\tphys_port_cnt:\t\t\t1
\t\tport:\t1
\t\t\tstate:\t\t\tPORT_DOWN (1)
"""

DF_MAC = """Filesystem     1024-blocks      Used Available Capacity  Mounted on
/dev/disk3s5    971350180 512345678 423456789    55%    /System/Volumes/Data
"""


def rdma_output(status: str, devices: str = "", devinfo: str = "") -> Output:
    return Output(0, f"{status}\n%%\n{devices}\n%%\n{devinfo}")


# ---- parsers -------------------------------------------------------------------------------


def test_sw_vers_and_versions():
    info = checks.parse_sw_vers(SW_VERS)
    assert info == {"ProductName": "macOS", "ProductVersion": "26.2", "BuildVersion": "25C56"}
    assert checks.parse_version("26.2") == (26, 2) > (26, 1, 9)
    assert checks.parse_version("15.6.1") == (15, 6, 1)
    assert checks.parse_version("") == ()


def test_sysctl():
    assert checks.parse_sysctl(SYSCTL) == {"machdep.cpu.brand_string": "Apple M4 Max",
                                           "hw.memsize": "137438953472"}
    assert checks.parse_memory(SYSCTL) == 128 * GIB
    assert checks.parse_memory("model name\t: AMD EPYC\nMemTotal:       32768 kB\n") == 32 << 20


def test_pmset_sections_and_odd_lines():
    current = checks.parse_pmset(PMSET_MINI)
    in_use = current["Currently in use"]
    # "Sleep On Power Button" starts with "sleep" too, and holds spaces: its own key.
    assert in_use["Sleep On Power Button"] == "1"
    assert in_use["sleep"] == "1 (sleep prevented by powerd, caffeinate)"
    assert checks.pmset_minutes(in_use["sleep"]) == 1
    assert in_use["hibernatefile"] == "/var/vm/sleepimage"
    custom = checks.parse_pmset(PMSET_CUSTOM_LAPTOP)
    assert set(custom) == {"Battery Power", "AC Power"}
    assert (custom["Battery Power"]["sleep"], custom["AC Power"]["sleep"]) == ("5", "0")
    assert checks.parse_pmset(PMSET_DISABLED)["System-wide power settings"] == {
        "SleepDisabled": "1"}


def test_thunderbolt_ports_and_peers():
    ports = checks.parse_thunderbolt(PROFILE)
    assert [(p.receptacle, p.speed, p.connected, p.peer) for p in ports] == [
        ("1", "80 Gb/s", True, "Mac Studio"),
        ("2", "Up to 120 Gb/s", False, ""),
        ("3", "40 Gb/s", True, ""),  # a drive is not a peer
    ]
    assert checks.parse_thunderbolt({}) == []


def test_rdma_ctl_and_ibv_tools():
    assert checks.parse_rdma_ctl("enabled\n") is True
    assert checks.parse_rdma_ctl("disabled\n") is False
    assert checks.parse_rdma_ctl("") is None
    assert checks.parse_ibv_devices(IBV_DEVICES) == ["rdma_en2", "rdma_en3"]
    assert checks.parse_ibv_devices("    device          \t   node GUID\n"
                                    "    ------          \t----------------\n") == []
    assert checks.parse_ibv_devinfo(IBV_DEVINFO) == {"rdma_en2": "PORT_ACTIVE",
                                                     "rdma_en3": "PORT_DOWN"}


def test_df():
    assert checks.parse_df(DF_MAC) == (423456789 * 1024, "/System/Volumes/Data")
    spaced = ("Filesystem 1024-blocks Used Available Capacity Mounted on\n"
              "map auto_home 0 0 0 100% /System/Volumes/Data/home\n")
    assert checks.parse_df(spaced) == (0, "/System/Volumes/Data/home")
    assert checks.parse_df("") is None


# ---- judgements ----------------------------------------------------------------------------


def test_macos_versions():
    assert checks.judge_macos(Output(0, SW_VERS), MAC).status == PASS
    old = checks.judge_macos(Output(0, SW_VERS_OLD), MAC)
    assert old.status == WARN and "26.2" in old.detail
    ancient = "ProductName:\tMac OS X\nProductVersion:\t12.7\n"
    assert checks.judge_macos(Output(0, ancient), MAC).status == FAIL


def test_memory_and_chip():
    r = checks.judge_memory(Output(0, SYSCTL), MAC)
    assert r.status == PASS and r.detail == "Apple M4 Max, 128 GiB (120 GiB for layers)"
    intel = "machdep.cpu.brand_string: Intel(R) Core(TM) i9\nhw.memsize: 34359738368\n"
    assert checks.judge_memory(Output(0, intel), MAC).status == FAIL
    small = "machdep.cpu.brand_string: Apple M1\nhw.memsize: 8589934592\n"
    assert checks.judge_memory(Output(0, small), MAC).status == WARN


def test_disk_against_the_planned_shard():
    out = Output(0, DF_MAC)  # about 404 GiB free
    assert checks.judge_disk(out, MAC).status == PASS
    big = Context(system="Darwin", shard_weight_bytes=400 * GIB)
    r = checks.judge_disk(out, big)
    assert r.status == FAIL and "416 GiB" in r.detail


def test_thunderbolt_judgement():
    r = checks.judge_thunderbolt(Output(0, json.dumps(PROFILE)), MAC)
    assert r.status == PASS and r.detail == "port 1 to Mac Studio at 80 Gb/s"
    tb4 = {"SPThunderboltDataType": [thunderbolt_bus("1", "40 Gb/s", "receptacle_connected",
                                                     [STUDIO])]}
    assert checks.judge_thunderbolt(Output(0, json.dumps(tb4)), MAC).status == WARN
    alone = {"SPThunderboltDataType": [thunderbolt_bus("1", "Up to 120 Gb/s",
                                                       "receptacle_no_devices_connected")]}
    r = checks.judge_thunderbolt(Output(0, json.dumps(alone)), MAC)
    assert r.status == WARN and "1 Thunderbolt 5 port(s), no Mac cabled" in r.detail
    assert checks.judge_thunderbolt(Output(1, "", "boom"), MAC).status == FAIL


def test_rdma_judgement():
    assert checks.judge_rdma(rdma_output("enabled", IBV_DEVICES, IBV_DEVINFO), MAC).detail == (
        "enabled: rdma_en2 PORT_ACTIVE, rdma_en3 PORT_DOWN")
    assert "rdma_ctl enable" in checks.judge_rdma(rdma_output("disabled"), MAC).fix
    assert checks.judge_rdma(Output(0, "\n%%\n\n%%\n"), MAC).detail.startswith("no rdma_ctl")
    down = IBV_DEVINFO.replace("PORT_ACTIVE (4)", "PORT_DOWN (1)")
    assert checks.judge_rdma(rdma_output("enabled", IBV_DEVICES, down), MAC).status == WARN


def test_wired_limit_against_the_shard():
    out = Output(0, SYSCTL_WIRED)  # 64 GiB, the default limit: about 48 GiB
    assert checks.default_wired_limit(64 * GIB) == 48 * GIB
    assert checks.default_wired_limit(36 * GIB) == 24 * GIB
    # No plan: the planner may give it 56 GiB, more than the GPU may wire.
    r = checks.judge_wired_limit(out, MAC)
    assert r.status == WARN and "sudo sysctl iogpu.wired_limit_mb=" in r.fix
    fits = Context(system="Darwin", shard_memory_bytes=30 * GIB)
    assert checks.judge_wired_limit(out, fits).status == PASS
    too_big = Context(system="Darwin", shard_memory_bytes=52 * GIB)
    r = checks.judge_wired_limit(out, too_big)
    assert r.status == FAIL and "iogpu.wired_limit_mb=55296" in r.fix
    raised = Output(0, "iogpu.wired_limit_mb: 57344\nhw.memsize: 68719476736\n")
    assert checks.judge_wired_limit(raised, too_big).status == PASS


def test_sleep_judgement():
    mini = Output(0, f"{PMSET_MINI}%%\n{PMSET_CUSTOM_MINI}")
    r = checks.judge_sleep(mini, MAC)
    assert r.status == WARN and r.fix == "sudo pmset -c sleep 0"
    laptop = Output(0, f"{PMSET_MINI}%%\n{PMSET_CUSTOM_LAPTOP}")
    r = checks.judge_sleep(laptop, MAC)
    assert r.status == WARN and "5 min idle on battery" in r.detail and "lid open" in r.detail
    assert r.fix == "sudo pmset -b sleep 0"
    awake = PMSET_CUSTOM_MINI.replace(" sleep                1", " sleep                0")
    assert checks.judge_sleep(Output(0, f"{PMSET_MINI}%%\n{awake}"), MAC).status == PASS
    assert checks.judge_sleep(Output(0, f"{PMSET_DISABLED}%%\n"), MAC).status == PASS


def test_firewall_judgement():
    off = "Firewall is disabled. (State = 0)\nBlock all DISABLED!\nFirewall stealth mode is off\n"
    assert checks.judge_firewall(Output(0, off), MAC).status == PASS
    on = "Firewall is enabled. (State = 1)\nBlock all DISABLED!\nFirewall stealth mode is on\n"
    r = checks.judge_firewall(Output(0, on), MAC)
    assert r.status == WARN and "stealth" in r.detail and "--unblockapp" in r.fix
    blocked = "Firewall is enabled. (State = 1)\nBlock all ENABLED!\n"
    assert checks.judge_firewall(Output(0, blocked), MAC).status == FAIL


def test_secret_file_judgement():
    digest = checks.secret_sha256("s3cret\n")
    good = (f"-rw------- 1 501 20 7 Jan  1 12:00 /Users/a/.omlx-cluster/secret\n"
            f"uid: 501\n{digest}  -\n")
    ctx = Context(system="Darwin", secret_sha256=checks.secret_sha256("s3cret"))
    assert checks.judge_secret(Output(0, good), ctx).status == PASS
    assert checks.judge_secret(Output(0, good.replace("-rw-------", "-rw-r--r--")),
                               ctx).status == FAIL
    assert checks.judge_secret(Output(0, good.replace("uid: 501", "uid: 502")), ctx).status == FAIL
    other = Context(system="Darwin", secret_sha256=checks.secret_sha256("another"))
    assert "another secret" in checks.judge_secret(Output(0, good), other).detail
    missing = Output(1, "", "ls: /Users/a/.omlx-cluster/secret: No such file or directory")
    assert checks.judge_secret(missing, ctx).status == WARN


def test_versions_compared_with_this_machine():
    here = checks.versions_check().detail
    same = json.dumps({"hosts": [{"checks": [{"name": "versions", "detail": here}]}]})
    assert judge_versions(Output(0, same), here, "omlx-cluster").status == PASS
    other = same.replace("mlx ", "mlx 0.0.1+")
    r = judge_versions(Output(0, other), here, "omlx-cluster")
    assert r.status == FAIL and "here: " in r.detail
    missing = judge_versions(Output(127, "", "sh: 1: omlx-cluster: not found"), here,
                             "omlx-cluster")
    assert missing.status == FAIL and "--remote-command" in missing.fix
    old = judge_versions(Output(0, "omlx-cluster 0.0.9\n"), here, "omlx-cluster")
    assert "too old for doctor" in old.detail


def test_clock_ports_and_link_judgements():
    assert judge_clock(Output(0, "1000\n"), 1000.2, 1000.4).status == PASS
    assert judge_clock(Output(0, "1010\n"), 1000.0, 1000.1).status == WARN
    assert judge_clock(Output(0, "1200\n"), 1000.0, 1000.1).status == FAIL
    assert judge_ports("10.0.0.2", {"gRPC 50051": "answers",
                                    "metrics 9101": "refused"}).status == PASS
    assert judge_ports("10.0.0.2", {"gRPC 50051": "filtered"}).status == WARN
    fast = {"gb_per_s": 9.5, "latency_us": 40.0, "nbytes": 8 << 20}
    assert judge_link("mac-b", fast, "").status == PASS
    wifi = {"gb_per_s": 0.05, "latency_us": 3000.0, "nbytes": 8 << 20}
    assert judge_link("mac-b", wifi, "").status == WARN
    assert judge_link("mac-b", None, "rank 1 on x: no link").status == FAIL
