"""`omlx-cluster doctor`: is every Mac ready to be a node? One table of what passes, what to fix
and how.

On each host, over SSH and all hosts at once (omlx_cluster/ssh.py), it runs the checks of
omlx_shared/checks.py: the same commands every node runs on itself at join. On top come the
checks only a view from here can make: the same versions everywhere (as this machine's, the
coordinator's when doctor runs there), clock skew, whether the coordinator's ports reach the
node, Bonjour visibility, and the data plane's bandwidth and latency between ring neighbours
(omlx_shared/link_probe.py, its two ranks run at once on the two Macs). `--model` plans the model
over the hosts' memory, so the disk and GPU wired-memory checks judge each host's planned
shard. With no host, it checks this machine without SSH.

The remote side needs no omlx-cluster for most checks (they are the macOS tools); the versions
and link checks run `--remote-command` there (default: `omlx-cluster` on the PATH of an SSH
session).
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omlx_cluster import ssh
from omlx_shared import checks
from omlx_shared.auth import REGISTRATION_WINDOW_SECONDS
from omlx_shared.checks import FAIL, PASS, SKIP, WARN, CheckResult, Context, Output, Probe

if TYPE_CHECKING:
    from rich.console import Console

    from omlx_shared.discovery import NodeAnnouncement

CLOCK_SKEW_WARN_SECONDS = 2.0  # `date +%s` has 1 s resolution: less is noise
LINK_MIN_GB_PER_S = 1.0  # below 10 GbE: a pipeline's decode steps wait on the link
LINK_MAX_LATENCY_US = 1000.0
PORT_TIMEOUT_SECONDS = 2.0


@dataclass
class DoctorOptions:
    timeout: float = 10.0  # seconds to connect and log in over SSH
    ssh_config: Path | None = None  # None: ~/.ssh/config
    remote_command: str = "omlx-cluster"  # how to run omlx-cluster on the hosts
    secret: str | None = None  # --secret-file's secret: every host's file must hold it
    secret_file: Path | None = None  # checked itself without hosts
    model: Path | None = None  # plan it over the hosts: disk and wired memory per shard
    only: set[str] | None = None  # the checks to run (None: all)
    grpc_port: int = 50051
    metrics_port: int = 9101
    # Rank 0 of a link probe listens here, rank 1 on the next port. Below the ephemeral ranges
    # (Linux 32768-60999, macOS 49152-65535): 50070 could be held by a Mac's own connection.
    probe_port: int = 31070
    probe_timeout: float = 30.0
    bonjour_seconds: float = 3.0

    def wanted(self, name: str) -> bool:
        return self.only is None or name in self.only


@dataclass
class HostReport:
    host: str  # as given
    address: str = ""  # the address SSH reached
    system: str = ""  # `uname -s`
    error: str = ""  # why it could not be checked at all
    results: list[CheckResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"host": self.host, "address": self.address, "system": self.system,
                "error": self.error, "checks": [r.to_dict() for r in self.results]}

    @property
    def failed(self) -> bool:
        return bool(self.error) or any(r.status == FAIL for r in self.results)


@dataclass
class Diagnosis:
    hosts: list[HostReport]
    plan: dict | None = None  # --model: {"model", "stages"} or {"model", "error"}

    @property
    def failed(self) -> bool:
        """A host failed, or the model (--model) fits on none of them."""
        return any(h.failed for h in self.hosts) or bool(self.plan and self.plan.get("error"))

    def to_dict(self) -> dict:
        return {"ok": not self.failed, "plan": self.plan,
                "hosts": [h.to_dict() for h in self.hosts]}


@dataclass
class _Host:
    report: HostReport
    remote: ssh.Remote | None = None
    outputs: dict[str, Output] = field(default_factory=dict)
    extra: list[CheckResult] = field(default_factory=list)  # judged while collecting

    @property
    def conn(self) -> ssh.Remote:
        assert self.remote is not None, "only a host that was reached gets here"
        return self.remote


# ---- judgements of what only a view from here can tell (pure) --------------------------------


def judge_versions(out: Output, here: str, command: str) -> CheckResult:
    """The host's versions (`doctor --check versions --json` run there) against this
    machine's `here` ("omlx-cluster 0.1.0, Python 3.12.4, mlx ..., mlx-lm ...")."""
    text = out.stdout.strip()
    try:
        found = next(c["detail"] for c in json.loads(text)["hosts"][0]["checks"]
                     if c["name"] == "versions")
    except (ValueError, KeyError, IndexError, StopIteration, TypeError):
        if out.returncode == 127 or not text:
            return CheckResult("versions", FAIL, f"`{command}` not found there "
                               f"({(out.stderr.strip().splitlines() or ['no output'])[-1]})",
                               "install omlx-cluster there, or pass --remote-command with its "
                               "full path (an SSH session's PATH is short)")
        return CheckResult("versions", FAIL, f"{text} (too old for doctor); here: {here}",
                           "install the same omlx-cluster as here")
    if found != here:
        return CheckResult("versions", FAIL, f"{found}; here: {here}", "install the same "
                           "versions everywhere (the same pip install line, the same Python)")
    return CheckResult("versions", PASS, found)


def judge_clock(out: Output, sent: float, received: float) -> CheckResult:
    """The host's `date +%s` against this machine's clock between sending and receiving."""
    try:
        theirs = int(out.stdout.strip()) + 0.5  # the middle of the second it printed
    except ValueError:
        return CheckResult("clock", FAIL, f"date gave {out.stdout.strip()!r}")
    skew = theirs - (sent + received) / 2
    detail = f"{skew:+.1f} s from this machine (±{(received - sent) / 2 + 0.5:.1f} s)"
    fix = ("turn on Set time and date automatically (System Settings > General > Date & Time), "
           "or `sudo sntp -sS time.apple.com`")
    if abs(skew) > REGISTRATION_WINDOW_SECONDS:
        return CheckResult("clock", FAIL, detail + ": the coordinator refuses the signed "
                           f"registrations of `join --coordinator` beyond "
                           f"{REGISTRATION_WINDOW_SECONDS:.0f} s", fix)
    if abs(skew) > CLOCK_SKEW_WARN_SECONDS:
        return CheckResult("clock", WARN, detail + ": logs and metrics of the Macs disagree",
                           fix)
    return CheckResult("clock", PASS, detail)


def judge_ports(address: str, states: dict[str, str]) -> CheckResult:
    """`states`: {"gRPC 50051": "answers" | "refused" | "filtered"} as dialled from here."""
    said = {"answers": "answers", "refused": "reachable, nothing listens yet",
            "filtered": "no answer (filtered)"}
    detail = f"from here to {address}: " + ", ".join(
        f"{port} {said[state]}" for port, state in states.items())
    if "filtered" in states.values():
        return CheckResult("ports", WARN, detail, "a firewall drops them: allow them in the "
                           "Mac's firewall and the network's (omlx-cluster doctor's firewall "
                           "row says how)")
    return CheckResult("ports", PASS, detail)


def judge_bonjour(address: str, port: int, seen: list[NodeAnnouncement],
                  error: str) -> CheckResult:
    """Whether a node announced at `address` (on gRPC `port`, if one is) was among `seen`
    (NodeAnnouncements)."""
    if error:
        return CheckResult("bonjour", WARN, f"cannot browse Bonjour here: {error}")
    mine = sorted((a for a in seen if a.host == address), key=lambda a: a.port != port)
    if mine:
        a = mine[0]
        return CheckResult("bonjour", PASS, f"announced as {a.node_id} (omlx-cluster "
                           f"{a.version}, gRPC port {a.port})")
    return CheckResult("bonjour", WARN, f"no node announced from {address} here", "start join "
                       "(`omlx-cluster up`); if it runs, multicast does not cross this network: "
                       "give join --coordinator HOST:PORT (up does)")


def judge_link(peer: str, measured: dict | None, error: str) -> CheckResult:
    """A link probe's result (rank 0's JSON) towards `peer`."""
    if error or not measured:
        return CheckResult("link", FAIL, f"to {peer}: {error or 'no measurement'}",
                           "both Macs must reach each other on the probe ports (--probe-port "
                           "and the next): check the firewall rows")
    rate, latency = measured["gb_per_s"], measured["latency_us"]
    detail = (f"to {peer}: {rate:.2f} GB/s, {latency:.0f} µs one way "
              f"({measured['nbytes'] >> 20} MiB messages, ring over TCP)")
    if rate < LINK_MIN_GB_PER_S or latency > LINK_MAX_LATENCY_US:
        return CheckResult("link", WARN, detail, "a pipeline's every step crosses this link: "
                           "use Thunderbolt (IP over Thunderbolt, or RDMA) or 10 GbE, not Wi-Fi")
    return CheckResult("link", PASS, detail)


# ---- collecting -------------------------------------------------------------------------------


def versions_command(command: str) -> str:
    """Asks the host's omlx-cluster (`command`) for its versions; one too old for doctor (exit
    status 2: no such subcommand) answers with its --version."""
    return (f"{command} doctor --check versions --json 2>/dev/null; "
            f"test $? -le 1 || {command} --version")


def _probes(options: DoctorOptions) -> list[Probe]:
    return [p for p in (*checks.PROBES, checks.secret_probe(checks.REMOTE_SECRET_PATH))
            if options.wanted(p.name)]


async def _collect(spec: str, options: DoctorOptions, here: str) -> _Host:
    host = _Host(HostReport(spec))
    try:
        host.remote = remote = await ssh.connect(spec, options.timeout, options.ssh_config)
    except ssh.SshError as e:
        host.report.error = str(e)
        return host
    host.report.address = remote.address
    system = (await remote.run("uname -s", timeout=options.timeout)).stdout.strip()
    host.report.system = system or "unknown"
    gate = asyncio.Semaphore(4)  # sshd opens at most 10 sessions per connection (MaxSessions)

    async def run(name: str, command: str) -> None:
        async with gate:
            host.outputs[name] = await remote.run(command, timeout=checks.COMMAND_TIMEOUT_SECONDS)

    jobs = [run(p.name, p.commands[system]) for p in _probes(options) if system in p.commands]
    cmd = options.remote_command
    if options.wanted("versions"):
        jobs.append(run("versions", versions_command(cmd)))
    await asyncio.gather(*jobs)
    if options.wanted("versions"):
        host.extra.append(judge_versions(host.outputs.pop("versions"), here, cmd))
    if options.wanted("clock"):
        sent = time.time()
        out = await remote.run("date +%s", timeout=options.timeout)
        host.extra.append(judge_clock(out, sent, time.time()))
    if options.wanted("ports"):
        ports = {f"gRPC {options.grpc_port}": options.grpc_port,
                 f"metrics {options.metrics_port}": options.metrics_port}
        states = {name: await _dial(remote.address, port) for name, port in ports.items()}
        host.extra.append(judge_ports(remote.address, states))
    return host


async def _dial(address: str, port: int) -> str:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(address, port),
                                           PORT_TIMEOUT_SECONDS)
    except ConnectionRefusedError:
        return "refused"
    except (asyncio.TimeoutError, OSError):
        return "filtered"
    writer.close()
    return "answers"


def _browse(interfaces: list[str], seconds: float) -> tuple[list[NodeAnnouncement], str]:
    """The node announcements seen on `interfaces` within `seconds` (blocking)."""
    from omlx_shared.discovery import Browser

    seen: list[NodeAnnouncement] = []
    try:
        with Browser(seen.append, lambda node_id: None, interfaces):
            time.sleep(seconds)
    except OSError as e:
        return [], str(e)
    return seen, ""


def _plan(model: Path, memories: dict[str, int]) -> tuple[dict, dict[str, tuple[int, int]]]:
    """Plans `model` over the hosts of `memories` ({host: total memory}): (the plan for people,
    {host: (weight bytes, memory bytes)} of each one's shard)."""
    from omlx_coordinator.planning.model_layout import read_layout
    from omlx_coordinator.planning.planner import NodeSpec, make_plan

    # The planner's node names are words: number the hosts, name them back after.
    hosts = list(memories)
    nodes = [NodeSpec(f"host{i}", memories[h]) for i, h in enumerate(hosts)]
    try:
        plan = make_plan(read_layout(model), nodes)
    except ValueError as e:  # a PlanError, or a family no stage can serve (read_layout)
        return {"model": model.name, "error": str(e)}, {}
    stages = [(hosts[int(s.node.removeprefix("host"))], s) for s in plan.stages]
    shards = dict.fromkeys(hosts, (0, 0))  # a host the plan leaves out holds nothing
    shards.update({h: (s.weight_bytes, s.memory_bytes) for h, s in stages})
    return {"model": model.name, "stages": [
        {"host": h, "layers": [s.layer_start, s.layer_end], "weight_bytes": s.weight_bytes,
         "memory_bytes": s.memory_bytes} for h, s in stages]}, shards


async def _link(a: _Host, b: _Host, options: DoctorOptions) -> tuple[dict | None, str]:
    """Runs the two ranks of a link probe at once, rank 0 on `a`; (rank 0's result, error)."""
    peers = f"{a.conn.address}:{options.probe_port},{b.conn.address}:{options.probe_port + 1}"
    command = (f"{options.remote_command} link-probe --peers {peers} --json --timeout "
               f"{options.probe_timeout:g} --rank")
    outs = await asyncio.gather(*(h.conn.run(f"{command} {rank}",
                                             timeout=options.probe_timeout + 15)
                                  for rank, h in ((0, a), (1, b))))
    for h, out in zip((a, b), outs):
        if out.returncode != 0:
            lines = (out.stderr.strip() or out.stdout.strip()).splitlines()
            return None, f"{h.report.host}: {lines[-1] if lines else f'exit {out.returncode}'}"
    try:
        return json.loads(outs[0].stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"{a.report.host}: no measurement in {outs[0].stdout.strip()!r}"


def _ring_pairs(n: int) -> list[tuple[int, int]]:
    """The ring links of n stages in the given order: i to i + 1, and the last to the first."""
    return [] if n < 2 else [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]


async def diagnose(specs: list[str], options: DoctorOptions) -> Diagnosis:
    """Checks every host in `specs` (order: the ring's) at once."""
    here = checks.versions_check().detail
    collected = await asyncio.gather(*(_collect(s, options, here) for s in specs))
    try:
        return await _judge(collected, options)
    finally:
        await asyncio.gather(*(h.remote.close() for h in collected if h.remote is not None))


async def _judge(collected: list[_Host], options: DoctorOptions) -> Diagnosis:
    up = [h for h in collected if h.remote is not None]
    browsing = None
    if options.wanted("bonjour") and up:
        # Browse where the SSH connections leave this machine: the networks the nodes are on.
        interfaces = sorted({h.conn.local_address for h in up
                             if ":" not in h.conn.local_address})  # IPv4 only, as discovery
        browsing = asyncio.create_task(
            asyncio.to_thread(_browse, interfaces, options.bonjour_seconds))
    memories = {h.report.host: checks.parse_memory(h.outputs["memory"].stdout)
                for h in up if "memory" in h.outputs}
    plan, shards = (_plan(options.model, {k: v for k, v in memories.items() if v})
                    if options.model else (None, {}))
    secret_hash = checks.secret_sha256(options.secret) if options.secret else None
    for h in up:
        weights, memory = shards.get(h.report.host, (None, None))
        ctx = Context(system=h.report.system, shard_weight_bytes=weights,
                      shard_memory_bytes=memory, secret_sha256=secret_hash)
        h.report.results = [r for r in h.extra if r.name == "versions"] + [
            p.judge(h.outputs[p.name], ctx) if p.name in h.outputs
            else checks.not_applicable(p, h.report.system) for p in _probes(options)
        ] + [r for r in h.extra if r.name != "versions"]
    if browsing is not None:
        seen, error = await browsing
        for h in up:
            h.report.results.append(judge_bonjour(h.report.address, options.grpc_port, seen,
                                                     error))
    if options.wanted("link"):
        if len(up) == 1:
            up[0].report.results.append(CheckResult("link", SKIP, "one host: no ring neighbour"))
        # One pair at a time: a Mac in two pairs would otherwise share its link between both.
        for i, j in _ring_pairs(len(up)):
            measured, error = await _link(up[i], up[j], options)
            up[i].report.results.append(judge_link(up[j].report.host, measured, error))
            up[j].report.results.append(judge_link(up[i].report.host, measured, error))
    return Diagnosis([h.report for h in collected], plan)


def check_here(options: DoctorOptions) -> Diagnosis:
    """`doctor` with no host: this machine's checks, run here without SSH."""
    from omlx_shared.hardware import machine_memory

    plan, ctx = None, Context(system=platform.system())
    if options.model:
        plan, shards = _plan(options.model, {"this machine": machine_memory()})
        weights, memory = shards.get("this machine", (None, None))
        ctx = Context(system=ctx.system, shard_weight_bytes=weights, shard_memory_bytes=memory)
    results = checks.local_checks(ctx, secret_file=options.secret_file, only=options.only)
    return Diagnosis([HostReport("this machine", system=ctx.system, results=results)], plan)


# ---- showing ----------------------------------------------------------------------------------

_STYLES = {PASS: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render(diagnosis: Diagnosis, console: Console) -> None:
    """The diagnosis as one table: a section per host, a row per check, with the fix."""
    from rich.table import Table
    from rich.text import Text

    if diagnosis.plan is not None:
        plan = diagnosis.plan
        console.print(Text(f"plan for {plan['model']}: " + (plan.get("error") or ", ".join(
            f"{s['host']} layers [{s['layers'][0]}, {s['layers'][1]}) "
            f"({checks.size_text(s['memory_bytes'])})" for s in plan["stages"]))))
    table = Table("host", "check", "result", "detail", "fix", show_lines=False)
    for h in diagnosis.hosts:
        label = f"{h.host}\n{h.address}" if h.address and h.address != h.host else h.host
        if h.error:
            table.add_row(Text(label), "ssh", Text(FAIL, style=_STYLES[FAIL]), Text(h.error), "")
        for i, r in enumerate(h.results):
            table.add_row(Text(label if i == 0 else ""), r.name,
                          Text(r.status, style=_STYLES[r.status]), Text(r.detail), Text(r.fix))
        table.add_section()
    console.print(table)
    counts = {s: sum(r.status == s for h in diagnosis.hosts for r in h.results)
              for s in (FAIL, WARN)}
    unreachable = sum(bool(h.error) for h in diagnosis.hosts)
    console.print(Text(f"{len(diagnosis.hosts)} host(s): {counts[FAIL] + unreachable} fail, "
                       f"{counts[WARN]} warn" + (f" ({unreachable} unreachable)"
                                                 if unreachable else "")
                       + ("; the model cannot be planned on them (above)"
                          if diagnosis.plan and diagnosis.plan.get("error") else "")))


def read_hosts_file(path: Path) -> list[str]:
    """One host per line, in ring order; blank lines and `#` comments skipped."""
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]
