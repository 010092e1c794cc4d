"""Is this machine ready to be a node? The checks `omlx-cluster doctor` runs on every Mac, and
that every node agent runs once on itself when it starts (its Health reply carries the results
to `omlx-cluster status`).

A check is a shell command that only reads the machine, and a pure judgement of its output. The
command is the same whether it runs here (`doctor` with no host, a node at join) or on another
Mac over SSH (`doctor HOST ...`, omlx_cluster/doctor.py), so a check that passes in one place
means the same in the other. Commands are POSIX sh and keyed by `uname -s`: a check without a
command for this system does not apply here (the Mac-only ones say "not macOS").

The parsers read the tools' documented output formats (`sw_vers`, `sysctl`, `pmset -g`,
`system_profiler SPThunderboltDataType -json`, `rdma_ctl status`, `ibv_devices`,
`ibv_devinfo`, `df -P`, `socketfilterfw`); tests/test_checks_parsers.py holds examples of each.
hardware_checklist.md says why each check matters and how to run it by hand.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from omlx_shared import __version__
from omlx_shared.blas import OPENBLAS, OPENBLAS_PACKAGE

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
GIB = 1 << 30

MIN_MACOS_FOR_MLX = (13, 5)  # MLX's wheels
MIN_MACOS_FOR_RDMA = (26, 2)  # RDMA over Thunderbolt 5 (Apple TN3205)
OS_RESERVE_BYTES = 8 * GIB  # the coordinator's default --os-reserve: never planned for layers
KV_CACHE_DISK_BYTES = 16 * GIB  # a node's default --paged-ssd-cache-max-size
COMMAND_TIMEOUT_SECONDS = 30.0  # system_profiler takes a few seconds on a busy Mac
SECTION = "%%"  # separates the outputs of a check that runs several tools

# A node's data folder as its shell spells it (model_store.data_home's rule), and the file in it
# that holds the cluster secret (`omlx-cluster up` copies it there).
HOME_EXPR = "${OMLX_CLUSTER_HOME:-$HOME/.omlx-cluster}"
REMOTE_SECRET_PATH = f'"{HOME_EXPR}/secret"'


@dataclass(frozen=True)
class CheckResult:
    name: str  # the check's id: "macos", "sleep", ...
    status: str  # PASS, WARN, FAIL or SKIP
    detail: str  # what was found
    fix: str = ""  # what to do about it (empty when nothing needs doing)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Output:
    """What a check's command left: exit status, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str = ""


@dataclass(frozen=True)
class Context:
    """What a judgement needs besides the command's output."""

    system: str  # `uname -s`: "Darwin", "Linux"
    # The shard this machine is planned to hold (doctor --model), None when unknown.
    shard_weight_bytes: int | None = None
    shard_memory_bytes: int | None = None  # weights plus the KV reserve
    secret_sha256: str | None = None  # the secret the node's file must hold (its sha256)


@dataclass(frozen=True)
class Probe:
    name: str
    commands: Mapping[str, str]  # `uname -s` -> the command; a system missing: not applicable
    judge: Callable[[Output, Context], CheckResult]


# ---- parsers (pure) ----------------------------------------------------------------------------


def _key_values(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_sw_vers(text: str) -> dict[str, str]:
    """`sw_vers`: {"ProductName": "macOS", "ProductVersion": "26.2", "BuildVersion": ...}."""
    return _key_values(text)


def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl NAME ...` (with names: "hw.memsize: 68719476736" per line)."""
    return _key_values(text)


def parse_version(text: str) -> tuple[int, ...]:
    """"26.2.1" -> (26, 2, 1); () when it is not a version."""
    parts = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in parts.group().split(".")) if parts else ()


# A pmset setting: the key (which may hold spaces: "Sleep On Power Button"), then a number with
# an optional note ("1 (sleep prevented by powerd, caffeinate)") or one word or path.
_PMSET_LINE = re.compile(r"^\s*(?P<key>\S.*?)\s+(?P<value>-?\d+(?:\s+\(.*\))?|\S+)\s*$")


def parse_pmset(text: str) -> dict[str, dict[str, str]]:
    """`pmset -g` or `pmset -g custom`: {section: {setting: value}}, the sections as the tool
    heads them ("System-wide power settings", "Currently in use", "Battery Power", "AC Power",
    "UPS Power")."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() and line.rstrip().endswith(":"):
            current = sections.setdefault(line.strip()[:-1], {})
        elif current is not None and (m := _PMSET_LINE.match(line)):
            current[m["key"]] = m["value"]
    return sections


def pmset_minutes(value: str | None) -> int | None:
    """A pmset timer's minutes ("10", "1 (sleep prevented by powerd)"); None when unset."""
    if value is None:
        return None
    m = re.match(r"-?\d+", value)
    return int(m.group()) if m else None


@dataclass(frozen=True)
class ThunderboltPort:
    receptacle: str  # the port's number ("1")
    speed: str  # as reported: "Up to 120 Gb/s" (free port), "80 Gb/s" (a link's speed)
    connected: bool
    peer: str  # the Mac cabled straight to it ("" when none)


def _gbps(speed: str) -> int | None:
    m = re.search(r"(\d+)\s*Gb/s", speed)
    return int(m.group(1)) if m else None


def parse_thunderbolt(profile: dict) -> list[ThunderboltPort]:
    """The ports of `system_profiler SPThunderboltDataType -json` (parsed JSON), one per bus.
    A peer is a Mac: an item with its own Thunderbolt domain UUID (a drive or a dock has none)."""
    ports = []
    for bus in profile.get("SPThunderboltDataType", []):
        tag = bus.get("receptacle_1_tag") or {}
        macs = [item.get("_name") or item.get("device_name_key") or "a Mac"
                for item in bus.get("_items", []) if item.get("domain_uuid_key")]
        ports.append(ThunderboltPort(
            receptacle=str(tag.get("receptacle_id_key", "?")),
            speed=str(tag.get("current_speed_key", "")),
            connected=tag.get("receptacle_status_key") == "receptacle_connected",
            peer=macs[0] if macs else ""))
    return sorted(ports, key=lambda p: p.receptacle)


def parse_rdma_ctl(text: str) -> bool | None:
    """`rdma_ctl status`: "enabled" -> True, "disabled" -> False, anything else None."""
    return {"enabled": True, "disabled": False}.get(text.strip().lower())


def parse_ibv_devices(text: str) -> list[str]:
    """The device names of `ibv_devices` (a header, a dashed rule, then "device  GUID" rows)."""
    rows = text.splitlines()
    rule = next((i for i, line in enumerate(rows) if line.strip().startswith("---")), -1)
    return [line.split()[0] for line in rows[rule + 1:] if line.split()]


def parse_ibv_devinfo(text: str) -> dict[str, str]:
    """{device: port state} from `ibv_devinfo` ("hca_id: rdma_en2" ... "state: PORT_ACTIVE (4)")."""
    states: dict[str, str] = {}
    device = None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "hca_id":
            device = value.strip()
        elif key == "state" and device is not None and device not in states:
            states[device] = value.split()[0] if value.split() else ""
    return states


def parse_df(text: str) -> tuple[int, str] | None:
    """(free bytes, mount point) from `df -Pk PATH` (POSIX format, 1024-byte blocks)."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        # From the right: "Capacity" is the field with '%', "Available" just before it (a
        # filesystem name may hold spaces, the mount point too).
        pct = next((i for i in range(len(fields) - 1, 0, -1) if fields[i].endswith("%")), None)
        if pct is not None and fields[pct - 1].isdigit():
            return int(fields[pct - 1]) * 1024, " ".join(fields[pct + 1:])
    return None


def parse_memory(text: str) -> int | None:
    """Total memory in bytes from the memory check's output (`sysctl hw.memsize` on macOS,
    /proc/meminfo's MemTotal in kB on Linux)."""
    values = _key_values(text)
    if values.get("hw.memsize", "").isdigit():
        return int(values["hw.memsize"])
    total = values.get("MemTotal", "").split()
    return int(total[0]) * 1024 if total and total[0].isdigit() else None


def sections(text: str) -> list[str]:
    """The outputs of a check that ran several tools, split at SECTION lines."""
    parts, current = [], []
    for line in text.splitlines():
        if line.strip() == SECTION:
            parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    return [*parts, "\n".join(current)]


# ---- judgements (pure) -------------------------------------------------------------------------


def size_text(n: int) -> str:
    """Bytes for people: "120 GiB", "7.5 GiB", "300 MiB"."""
    if n >= 10 * GIB:
        return f"{n / GIB:.0f} GiB"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def judge_macos(out: Output, ctx: Context) -> CheckResult:
    info = parse_sw_vers(out.stdout)
    text = info.get("ProductVersion", "")
    version = parse_version(text)
    if not version:
        return CheckResult("macos", FAIL, f"sw_vers gave no version: {out.stderr.strip()}",
                           "run `sw_vers` by hand")
    if version < MIN_MACOS_FOR_MLX:
        return CheckResult("macos", FAIL, f"macOS {text}: MLX needs 13.5 or later",
                           "update macOS (System Settings > General > Software Update)")
    if version < MIN_MACOS_FOR_RDMA:
        return CheckResult("macos", WARN, f"macOS {text}: no RDMA over Thunderbolt before 26.2 "
                           "(the ring backend, TCP, works)", "update to macOS 26.2 or later")
    return CheckResult("macos", PASS, f"macOS {text} ({info.get('BuildVersion', '?')})")


def judge_memory(out: Output, ctx: Context) -> CheckResult:
    values = _key_values(out.stdout)
    chip = (values.get("machdep.cpu.brand_string") or values.get("model name")
            or values.get("machine") or "unknown processor")
    memory = parse_memory(out.stdout)
    if memory is None:
        return CheckResult("memory", FAIL, f"{chip}; total memory unknown: "
                           f"{out.stderr.strip() or out.stdout.strip()}")
    if ctx.system == "Darwin" and not chip.startswith("Apple"):
        return CheckResult("memory", FAIL, f"{chip}: MLX runs on Apple silicon only",
                           "leave this Mac out of the cluster")
    usable = memory - OS_RESERVE_BYTES
    if usable <= 0:
        return CheckResult("memory", WARN, f"{chip}, {size_text(memory)}: nothing left for "
                           f"layers after the {size_text(OS_RESERVE_BYTES)} kept for the OS",
                           "give the coordinator a smaller --os-reserve, or leave it out")
    return CheckResult("memory", PASS,
                       f"{chip}, {size_text(memory)} ({size_text(usable)} for layers)")


def versions() -> dict[str, str]:
    """The versions that must be the same on every node (the wire format and the numerics)."""
    from importlib import metadata

    found = {"omlx-cluster": __version__, "Python": platform.python_version()}
    for dist in ("mlx", "mlx-lm"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "missing"
    return found


def versions_check() -> CheckResult:
    """This interpreter's versions, read in-process (no command: it is the one that runs us)."""
    found = versions()
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    missing = [k for k, v in found.items() if v == "missing"]
    if missing:
        return CheckResult("versions", FAIL, detail,
                           f"pip install {' '.join(missing)} in the environment of omlx-cluster")
    return CheckResult("versions", PASS, detail)


def judge_disk(out: Output, ctx: Context) -> CheckResult:
    found = parse_df(out.stdout)
    if found is None:
        return CheckResult("disk", FAIL, f"df gave nothing readable: {out.stderr.strip()}")
    free, mount = found
    need = KV_CACHE_DISK_BYTES + (ctx.shard_weight_bytes or 0)
    what = (f"the shard's weights ({size_text(ctx.shard_weight_bytes)}) and the SSD KV cache"
            if ctx.shard_weight_bytes else
            "the SSD KV cache (doctor --model adds the planned shard's weights)")
    detail = f"{size_text(free)} free on {mount or '?'}; needs {size_text(need)}: {what}"
    if free < need:
        return CheckResult("disk", FAIL, detail, "free disk space, or start join with a smaller "
                           "--paged-ssd-cache-max-size")
    return CheckResult("disk", PASS, detail)


def judge_thunderbolt(out: Output, ctx: Context) -> CheckResult:
    try:
        ports = parse_thunderbolt(json.loads(out.stdout))
    except ValueError:
        return CheckResult("thunderbolt", FAIL, "system_profiler gave no JSON: "
                           f"{out.stderr.strip()[:200]}", "run `system_profiler "
                           "SPThunderboltDataType` by hand")
    fast = [p for p in ports if (_gbps(p.speed) or 0) >= 80]
    cabled = [p for p in ports if p.peer]
    if not cabled:
        have = (f"{len(fast)} Thunderbolt 5 port(s)" if fast
                else f"no Thunderbolt 5 port ({len(ports)} Thunderbolt port(s))")
        return CheckResult("thunderbolt", WARN, f"{have}, no Mac cabled: the data plane is TCP "
                           "over the LAN", "cable each Mac to its ring neighbours with "
                           "Thunderbolt 5 cables for RDMA" if fast else "")
    slow = [p for p in cabled if (_gbps(p.speed) or 0) < 80]
    links = ", ".join(f"port {p.receptacle} to {p.peer} at {p.speed}" for p in cabled)
    if slow:
        return CheckResult("thunderbolt", WARN, links, "a link under 80 Gb/s is not Thunderbolt 5"
                           " end to end: use a Thunderbolt 5 cable between TB5 ports")
    return CheckResult("thunderbolt", PASS, links)


def judge_rdma(out: Output, ctx: Context) -> CheckResult:
    status_text, devices_text, devinfo_text = (sections(out.stdout) + ["", "", ""])[:3]
    enabled = parse_rdma_ctl(status_text)
    if enabled is None:
        return CheckResult("rdma", WARN, "no rdma_ctl: RDMA over Thunderbolt needs macOS 26.2+ "
                           "(the ring backend, TCP, works)", "update to macOS 26.2 or later")
    if not enabled:
        return CheckResult("rdma", WARN, "RDMA over Thunderbolt is disabled (the ring backend, "
                           "TCP, works)", "in macOS Recovery: Utilities > Terminal, "
                           "`rdma_ctl enable`, reboot")
    devices = parse_ibv_devices(devices_text)
    if not devices:
        return CheckResult("rdma", WARN, "enabled, but ibv_devices lists no device",
                           "this Mac needs Thunderbolt 5 ports; reboot after `rdma_ctl enable`")
    states = parse_ibv_devinfo(devinfo_text)
    listed = ", ".join(f"{d} {states.get(d, '?')}" for d in devices)
    if not any(s == "PORT_ACTIVE" for s in states.values()):
        return CheckResult("rdma", WARN, f"enabled; no active port: {listed}",
                           "a port turns PORT_ACTIVE once the Mac cabled to it has RDMA enabled")
    return CheckResult("rdma", PASS, f"enabled: {listed}")


def default_wired_limit(memory: int) -> int:
    """What macOS lets the GPU wire when iogpu.wired_limit_mb is 0, as commonly measured (Metal's
    recommendedMaxWorkingSetSize): about two thirds of memory up to 36 GiB, three quarters
    above. An estimate: MLX reads the exact figure on the Mac itself."""
    return memory * 2 // 3 if memory <= 36 * GIB else memory * 3 // 4


def judge_wired_limit(out: Output, ctx: Context) -> CheckResult:
    values = parse_sysctl(out.stdout)
    memory = int(values["hw.memsize"]) if values.get("hw.memsize", "").isdigit() else None
    if memory is None or not values.get("iogpu.wired_limit_mb", "").isdigit():
        return CheckResult("wired-limit", FAIL, "sysctl has no iogpu.wired_limit_mb: "
                           f"{out.stderr.strip()}", "MLX needs an Apple silicon Mac")
    set_mb = int(values["iogpu.wired_limit_mb"])
    limit = set_mb << 20 if set_mb else default_wired_limit(memory)
    how = f"{set_mb} MB (set)" if set_mb else f"about {size_text(limit)} (macOS's default)"
    if ctx.shard_memory_bytes is not None:
        need, what, status = ctx.shard_memory_bytes, "the planned shard needs", FAIL
    else:
        # Without a plan, the most the planner may give this Mac.
        need, what, status = memory - OS_RESERVE_BYTES, "the planner may give it up to", WARN
    detail = f"the GPU may wire {how}; {what} {size_text(max(need, 0))}"
    if limit >= need:
        return CheckResult("wired-limit", PASS, detail)
    target = min(need + 2 * GIB, memory - 4 * GIB) >> 20
    return CheckResult("wired-limit", status, detail,
                       f"sudo sysctl iogpu.wired_limit_mb={target} (and the same line, without "
                       "sudo sysctl, in /etc/sysctl.conf to keep it after a reboot)")


def judge_sleep(out: Output, ctx: Context) -> CheckResult:
    current_text, custom_text = (sections(out.stdout) + ["", ""])[:2]
    current, custom = parse_pmset(current_text), parse_pmset(custom_text)
    if not current and not custom:
        return CheckResult("sleep", FAIL, f"pmset gave nothing readable: {out.stderr.strip()}")
    if current.get("System-wide power settings", {}).get("SleepDisabled") == "1":
        return CheckResult("sleep", PASS, "sleep disabled (pmset disablesleep)")
    problems, fixes = [], []
    for source, on, flag in (("AC Power", "on power", "-c"), ("Battery Power", "on battery", "-b"),
                             ("UPS Power", "on UPS", "-u")):
        minutes = pmset_minutes(custom.get(source, {}).get("sleep"))
        if minutes:
            problems.append(f"sleeps after {minutes} min idle {on}")
            fixes.append(f"sudo pmset {flag} sleep 0")
    if not custom:  # only `pmset -g`: the settings in use
        minutes = pmset_minutes(current.get("Currently in use", {}).get("sleep"))
        if minutes:
            problems.append(f"sleeps after {minutes} min idle")
            fixes.append("sudo pmset -a sleep 0")
    if not problems:
        return CheckResult("sleep", PASS, "never sleeps when idle")
    why = ("; a node agent holds it awake only while it has a shard loaded, and a sleeping "
           "Mac misses its re-plans")
    if "Battery Power" in custom:
        why += "; on battery, keep it on power with the lid open"
    return CheckResult("sleep", WARN, ", ".join(problems) + why, "; ".join(fixes))


def judge_blas(out: Output, ctx: Context) -> CheckResult:
    """Where MLX computes on the CPU (Linux without a CUDA GPU), whether a node preloads an
    optimised BLAS: MLX's wheel ships a reference one, on which prefill is several times
    slower."""
    found = set(out.stdout.split())
    if "metal" in found:
        return CheckResult("blas", PASS, "Metal: MLX computes on the GPU")
    if "gpu" in found:
        return CheckResult("blas", PASS, "a CUDA GPU: MLX computes there, not on the CPU's BLAS")
    if "openblas" in found:
        return CheckResult("blas", PASS, f"OpenBLAS ({OPENBLAS}), preloaded for MLX's CPU "
                                         "backend")
    if "reference" in found:
        return CheckResult("blas", PASS, "MLX's reference BLAS, as OMLX_BLAS=reference asks")
    return CheckResult("blas", WARN, "MLX's CPU backend runs on its reference BLAS: prompts "
                                     "prefill several times slower than with OpenBLAS",
                       f"sudo apt-get install {OPENBLAS_PACKAGE} (Debian, Ubuntu); nodes "
                       "preload it when they start")


def judge_firewall(out: Output, ctx: Context) -> CheckResult:
    text = out.stdout.lower()
    if "firewall is disabled" in text:
        return CheckResult("firewall", PASS, "application firewall off")
    if "firewall is enabled" not in text:
        return CheckResult("firewall", WARN, "firewall state unknown: "
                           f"{(out.stderr or out.stdout).strip()[:200]}",
                           "System Settings > Network > Firewall")
    if "block all enabled" in text:
        return CheckResult("firewall", FAIL, "the firewall blocks all incoming connections: no "
                           "coordinator can reach this node", "turn off \"Block all incoming "
                           "connections\" (System Settings > Network > Firewall > Options)")
    stealth = "stealth mode is on" in text
    return CheckResult("firewall", WARN, "application firewall on" + (
        " (stealth mode: a blocked port times out instead of refusing)" if stealth else ""),
        "allow incoming connections for the Python that runs omlx-cluster: `sudo "
        "/usr/libexec/ApplicationFirewall/socketfilterfw --add PYTHON --unblockapp PYTHON` "
        "(gRPC 50051, the data plane and metrics 9101 must reach it)")


def judge_secret(out: Output, ctx: Context) -> CheckResult:
    lines = out.stdout.splitlines()
    values = _key_values(out.stdout)
    listing = next((ln for ln in lines if ln[:1] in "-l" and len(ln.split()) > 3), None)
    if out.returncode != 0 or listing is None:
        return CheckResult("secret", WARN, "no secret file "
                           f"({(out.stderr.strip().splitlines() or ['missing'])[-1]})",
                           "`omlx-cluster up --secret-file F` copies it there (mode 0600)")
    mode, owner = listing.split()[0], listing.split()[2]
    if mode[4:10] != "------":
        return CheckResult("secret", FAIL, f"the secret file is readable by others ({mode})",
                           "chmod 600 on it")
    if values.get("uid") and owner != values["uid"]:
        return CheckResult("secret", FAIL, f"the secret file belongs to uid {owner}, not to the "
                           f"user that runs join (uid {values['uid']})", "chown it to that user")
    digest = next((ln.split()[0] for ln in lines if re.fullmatch(r"[0-9a-f]{64}\b.*", ln)), "")
    if ctx.secret_sha256 and digest != ctx.secret_sha256:
        return CheckResult("secret", FAIL, f"the secret file ({mode}) holds another secret than "
                           "--secret-file", "`omlx-cluster up --secret-file F` replaces it")
    return CheckResult("secret", PASS, f"{mode}, " + (
        "the same secret as --secret-file" if ctx.secret_sha256 else "owned by this user"))


def secret_command(path: str) -> str:
    """Reads the secret file at `path` (a shell word: quoted, and it may expand variables): its
    mode, its owner against the user's uid, and the sha256 of its content without line ends,
    so the secret itself never leaves the machine."""
    return (f"f={path}; ls -ln \"$f\" && echo \"uid: $(id -u)\" && tr -d '\\r\\n' < \"$f\" "
            "| (shasum -a 256 2>/dev/null || sha256sum)")


def secret_probe(path: str) -> Probe:
    return Probe("secret", {"Darwin": secret_command(path), "Linux": secret_command(path)},
                 judge_secret)


def secret_sha256(secret: str) -> str:
    import hashlib

    return hashlib.sha256(secret.replace("\r", "").replace("\n", "").encode()).hexdigest()


# The data folder, or its nearest existing parent before the first join made it.
_DISK = f'd="{HOME_EXPR}"; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; df -Pk "$d"'
_FIREWALL = ("f=/usr/libexec/ApplicationFirewall/socketfilterfw; "
             "$f --getglobalstate; $f --getblockall; $f --getstealthmode")

PROBES: tuple[Probe, ...] = (
    Probe("macos", {"Darwin": "sw_vers"}, judge_macos),
    Probe("memory", {"Darwin": "sysctl machdep.cpu.brand_string hw.memsize",
                     "Linux": "grep -m1 '^model name' /proc/cpuinfo; grep '^MemTotal' "
                              "/proc/meminfo; echo \"machine: $(uname -m)\""}, judge_memory),
    Probe("disk", {"Darwin": _DISK, "Linux": _DISK}, judge_disk),
    Probe("thunderbolt", {"Darwin": "system_profiler SPThunderboltDataType -json"},
          judge_thunderbolt),
    Probe("rdma", {"Darwin": f"rdma_ctl status; echo {SECTION}; ibv_devices; echo {SECTION}; "
                             "ibv_devinfo"}, judge_rdma),
    Probe("wired-limit", {"Darwin": "sysctl iogpu.wired_limit_mb hw.memsize"},
          judge_wired_limit),
    Probe("sleep", {"Darwin": f"pmset -g; echo {SECTION}; pmset -g custom"}, judge_sleep),
    Probe("firewall", {"Darwin": _FIREWALL}, judge_firewall),
    Probe("blas", {"Darwin": "echo metal",
                   "Linux": f'[ "${{OMLX_BLAS:-openblas}}" = reference ] && echo reference; '
                            f"[ -e {OPENBLAS} ] && echo openblas; "
                            "[ -e /dev/nvidiactl ] && echo gpu; true"}, judge_blas),
)


# Every check's name, in the order doctor shows them: the last four need a view from another
# machine (omlx_cluster/doctor.py, over SSH).
CHECK_NAMES = ("versions", *(p.name for p in PROBES), "secret", "clock", "ports", "bonjour", "link")
REMOTE_ONLY = CHECK_NAMES[-4:]


def not_applicable(probe: Probe, system: str) -> CheckResult:
    return CheckResult(probe.name, SKIP, "not macOS" if list(probe.commands) == ["Darwin"]
                       else f"no such check on {system}")


# ---- running them here -------------------------------------------------------------------------


def run_command(command: str, timeout: float = COMMAND_TIMEOUT_SECONDS) -> Output:
    """Runs a check's command on this machine, as `sh -c` (as doctor does over SSH)."""
    try:
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                              timeout=timeout, errors="replace", check=False)
    except subprocess.TimeoutExpired:
        return Output(124, "", f"no answer within {timeout:.0f} s")
    return Output(done.returncode, done.stdout, done.stderr)


def local_checks(context: Context | None = None, secret_file: Path | None = None,
                 only: set[str] | None = None) -> list[CheckResult]:
    """Every check of this machine (or those named in `only`), as a node runs them at join and
    `omlx-cluster doctor` with no host. Blocks for a few seconds on a Mac (system_profiler)."""
    context = context or Context(system=platform.system())
    probes = list(PROBES) + ([secret_probe(shlex.quote(str(secret_file)))] if secret_file else [])
    results = [versions_check()] if only is None or "versions" in only else []
    for probe in probes:
        if only is not None and probe.name not in only:
            continue
        command = probe.commands.get(context.system)
        results.append(probe.judge(run_command(command), context) if command
                       else not_applicable(probe, context.system))
    return results


def log_problems(results: list[CheckResult], logger: logging.Logger) -> None:
    """One log line per check that is not fine, with its fix."""
    for r in results:
        if r.status in (WARN, FAIL):
            logger.warning("check %s: %s: %s%s", r.name, r.status, r.detail,
                           f" (fix: {r.fix})" if r.fix else "")
