"""`omlx-cluster up` and `down`: put `join` on the Macs over SSH, and take it off again.

`up`, on every host at once, step by step (each step reported as it ends):

1. versions: the host's omlx-cluster, Python, MLX and mlx-lm must be this machine's (doctor's
   check); a host that differs is left alone.
2. secret: the cluster secret goes to `$OMLX_CLUSTER_HOME/secret` there (default
   ~/.omlx-cluster/secret), mode 0600, sent on the SSH channel's stdin: never on a command line.
3. job: on macOS the launchd job of deploy/launchd/com.omlx-cluster.join.plist, filled in
   (this omlx-cluster, the address SSH reached as `join --host`, `--secret-file`, the
   coordinator), copied to ~/Library/LaunchAgents and loaded with `launchctl bootstrap
   gui/UID`: launchd restarts join whenever it exits and starts it at login. Elsewhere (Linux:
   no launchd) join runs under `nohup` with a pid file next to the secret, and is not restarted.
4. admitted: polls the coordinator's /cluster/status until it lists the node as a live member.

Every step compares first and changes only what differs, so running `up` twice changes nothing.
`down` unloads the job (or stops the nohup'd join) and removes what step 3 installed.
"""

from __future__ import annotations

import asyncio
import plistlib
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omlx_cluster import ssh
from omlx_cluster.doctor import judge_versions, versions_command
from omlx_shared import checks

LABEL = "com.omlx-cluster.join"
TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "launchd" / f"{LABEL}.plist"
DATA_HOME = f'"{checks.HOME_EXPR}"'  # the node's data folder, as join sees it
AGENTS = '"$HOME/Library/LaunchAgents"'
STOP_TIMEOUT_SECONDS = 20.0  # join stops its shard worker first


@dataclass
class UpOptions:
    secret: str
    coordinator: str | None = None  # HOST:PORT join registers with, and up polls
    api_key: str | None = None  # the coordinator's, for /cluster/status
    remote_command: str = "omlx-cluster"
    node_port: int = 50051  # join's gRPC port
    metrics_port: int = 9101
    wait: float = 120.0  # seconds to wait for the admission (0: do not wait)
    timeout: float = 10.0  # SSH connect and login
    ssh_config: Path | None = None


Report = Callable[[str, str, str, str], None]  # (host, step, outcome, detail)
DONE, UNCHANGED, FAILED, SKIPPED = "done", "unchanged", "failed", "skipped"
WAITING = "waiting"  # a step still under way: said every PROGRESS_SECONDS
PROGRESS_SECONDS = 10.0
ADMISSION_POLL_SECONDS = 1.0  # how often `up` asks the coordinator whether a node was admitted


class StepFailed(RuntimeError):
    """A step that could not be done; the message says why."""


async def _must(remote: ssh.Remote, command: str, what: str, timeout: float = 60.0,
                input: str | None = None) -> str:
    """`command`'s stdout, or StepFailed naming `what` and the last line it printed."""
    out = await remote.run(command, timeout=timeout, input=input)
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()
        raise StepFailed(f"{what}: {said[-1] if said else f'exit status {out.returncode}'}")
    return out.stdout


def join_arguments(command: list[str], address: str, home: str, options: UpOptions) -> list[str]:
    """The `join` command line both launchd and nohup run: the template's arguments with its
    REPLACE_ values filled in, then the port, the secret file and the coordinator."""
    template = plistlib.loads(TEMPLATE.read_bytes())["ProgramArguments"]
    argv: list[str] = []
    for arg in template:
        if arg.startswith("REPLACE_PATH_TO/"):
            argv += command
        elif arg == "REPLACE_LAN_ADDRESS":
            argv.append(address)
        elif argv and argv[-1] == "--metrics-port":
            argv.append(str(options.metrics_port))
        else:
            argv.append(arg)
    argv += ["--port", str(options.node_port), "--secret-file", f"{home}/secret"]
    return argv + (["--coordinator", options.coordinator] if options.coordinator else [])


def launchd_plist(argv: list[str], home: str, home_was_set: bool) -> bytes:
    """The template's job running `argv`. The secret stays in its 0600 file: the template's
    OMLX_CLUSTER_SECRET goes, and OMLX_CLUSTER_HOME comes when the host sets it."""
    job = plistlib.loads(TEMPLATE.read_bytes())
    job["ProgramArguments"] = argv
    env = {k: v for k, v in job.get("EnvironmentVariables", {}).items()
           if k != "OMLX_CLUSTER_SECRET"}
    if home_was_set:
        env["OMLX_CLUSTER_HOME"] = home
    if env:
        job["EnvironmentVariables"] = env
    else:
        job.pop("EnvironmentVariables", None)
    return plistlib.dumps(job)


async def _secret(remote: ssh.Remote, system: str, home: str, secret: str) -> tuple[str, str]:
    path = shlex.quote(f"{home}/secret")
    found = checks.judge_secret(await remote.run(checks.secret_command(path)), checks.Context(
        system=system, secret_sha256=checks.secret_sha256(secret)))
    if found.status == checks.PASS:
        return UNCHANGED, f"{home}/secret (0600)"
    await _must(remote, f"umask 077 && mkdir -p {shlex.quote(home)} && cat > {path}.tmp && "
                        f"chmod 600 {path}.tmp && mv {path}.tmp {path}", "copying the secret",
                input=secret + "\n")
    return DONE, f"copied to {home}/secret (0600)"


async def _launchd_up(remote: ssh.Remote, plist: bytes) -> tuple[str, str]:
    path = f"{AGENTS}/{LABEL}.plist"
    domain = 'gui/"$(id -u)"'
    loaded = (await remote.run(f"launchctl print {domain}/{LABEL}")).returncode == 0
    current = await remote.run(f"cat {path}")
    if loaded and current.returncode == 0 and current.stdout == plist.decode():
        return UNCHANGED, f"launchd job {LABEL} loaded"
    if loaded:
        await _must(remote, f"launchctl bootout {domain}/{LABEL}", "launchctl bootout")
    await _must(remote, f"umask 077 && mkdir -p {AGENTS} && cat > {path}.tmp && mv {path}.tmp "
                        f"{path}", "writing the plist", input=plist.decode())
    await _must(remote, f"launchctl bootstrap {domain} {path}", "launchctl bootstrap (the gui "
                "domain needs the user logged in at the Mac)")
    return DONE, f"launchd job {LABEL} {'reloaded' if loaded else 'installed and loaded'}"


def _shell_word(word: str) -> str:
    """`word` quoted for the remote shell, a leading ~/ still meaning the home there."""
    return ('"$HOME"/' + shlex.quote(word[2:])) if word.startswith("~/") else shlex.quote(word)


def _pidfile(home: str) -> str:
    return shlex.quote(f"{home}/join.pid")


async def _running_join(remote: ssh.Remote, home: str) -> str:
    """The pid of the join `up` started there; "" when none runs (no pid file, the process
    gone, or its pid reused by another program)."""
    out = await remote.run(f"p=$(cat {_pidfile(home)} 2>/dev/null) && kill -0 \"$p\" 2>/dev/null"
                           " && echo \"$p\" && ps -o args= -p \"$p\"")
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 2 or " join " not in f" {lines[1]} ":
        return ""
    return lines[0].strip()


async def _nohup_up(remote: ssh.Remote, home: str, argv: list[str]) -> tuple[str, str]:
    wanted = shlex.join(argv)
    pid = await _running_join(remote, home)
    cmdfile = shlex.quote(f"{home}/join.cmd")
    if pid and (await remote.run(f"cat {cmdfile}")).stdout.strip() == wanted:
        return UNCHANGED, f"join runs (pid {pid}; Linux: nohup, no launchd)"
    if pid:
        await _stop_pid(remote, home, pid)
    log = shlex.quote(f"{home}/join.log")
    # setsid: out of the SSH session's process group, so its end does not take join along.
    started = await _must(remote, f"cd {shlex.quote(home)} && printf '%s\\n' {shlex.quote(wanted)}"
                                  f" > {cmdfile} && (setsid nohup {wanted} </dev/null >>{log} "
                                  f"2>&1 & echo $! > {_pidfile(home)}) && cat {_pidfile(home)}",
                          "starting join")
    return DONE, (f"join {'restarted' if pid else 'started'} with nohup (Linux: no launchd, not "
                  f"restarted if it exits), pid {started.strip()}, log {home}/join.log")


async def _stop_pid(remote: ssh.Remote, home: str, pid: str) -> None:
    await _must(remote, f"kill {pid}", f"stopping join (pid {pid})")
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while (await remote.run(f"kill -0 {pid}")).returncode == 0:
        if time.monotonic() > deadline:
            raise StepFailed(f"join (pid {pid}) did not stop within {STOP_TIMEOUT_SECONDS:.0f} s")
        await asyncio.sleep(0.3)
    await remote.run(f"rm -f {_pidfile(home)}")


async def _admitted(address: str, options: UpOptions,
                    progress: Callable[[str], None]) -> tuple[str, str]:
    """Waits for the coordinator to list the node as a member, saying how long it has waited
    every PROGRESS_SECONDS (up to --wait, 120 s by default: silence would look like a hang)."""
    import httpx

    if not options.coordinator:
        return SKIPPED, "not waiting (no --coordinator)"
    if options.wait <= 0:
        return SKIPPED, "not waiting (--wait 0)"
    url = f"http://{options.coordinator}/cluster/status"
    headers = {"authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    node = f"{address}:{options.node_port}"
    start, last = time.monotonic(), "no answer yet"
    deadline, said = start + options.wait, start
    async with httpx.AsyncClient(timeout=5, headers=headers) as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(url)
                if r.status_code == 401:
                    raise StepFailed(f"{url} wants an API key: pass --api-key")
                r.raise_for_status()
                member = next((n for n in r.json()["nodes"]
                               if n["address"] == node and n["alive"]), None)
                if member is not None:
                    layers = member["layers"]
                    return DONE, f"admitted as {member['id']}" + (
                        f", layers [{layers[0]}, {layers[1]})" if layers else "")
                last = "not a member yet"
            except httpx.HTTPError as e:
                last = f"{url}: {e}"
            if time.monotonic() - said >= PROGRESS_SECONDS:
                said = time.monotonic()
                progress(f"{last} after {said - start:.0f} s (waiting up to {options.wait:.0f} s)")
            await asyncio.sleep(ADMISSION_POLL_SECONDS)
    raise StepFailed(f"{node} not admitted within {options.wait:.0f} s ({last}): see the "
                     "node's log (/tmp/omlx-cluster-join.log on a Mac, join.log next to the "
                     "secret elsewhere)")


async def _up_host(spec: str, options: UpOptions, here: str, report: Report) -> bool:
    try:
        remote = await ssh.connect(spec, options.timeout, options.ssh_config)
    except ssh.SshError as e:
        report(spec, "ssh", FAILED, str(e))
        return False
    step = "ssh"
    try:
        report(spec, step, DONE, f"connected to {remote.address}")
        step = "versions"
        versions = judge_versions(await remote.run(versions_command(options.remote_command)),
                                  here, options.remote_command)
        if versions.status != checks.PASS:
            raise StepFailed(f"{versions.detail} ({versions.fix})")
        report(spec, step, DONE, versions.detail)
        system = (await _must(remote, "uname -s", "uname")).strip()
        home_line = await _must(remote, f'echo {DATA_HOME}; echo "${{OMLX_CLUSTER_HOME:+set}}"',
                                "reading the home")
        home, home_was_set = home_line.splitlines()[0], home_line.splitlines()[1:] == ["set"]
        step = "secret"
        report(spec, step, *await _secret(remote, system, home, options.secret))
        words = shlex.split(options.remote_command)
        # launchd runs no shell: the job names omlx-cluster by its full path.
        path = (await _must(remote, f"command -v {_shell_word(words[0])}",
                            f"finding {words[0]} on the host's PATH")).strip()
        argv = join_arguments([path, *words[1:]], remote.address, home, options)
        step = "job"
        if system == "Darwin":
            report(spec, step, *await _launchd_up(remote, launchd_plist(argv, home, home_was_set)))
        else:
            report(spec, step, *await _nohup_up(remote, home, argv))
        step = "admitted"
        report(spec, step, *await _admitted(
            remote.address, options, lambda detail: report(spec, "admitted", WAITING, detail)))
        return True
    except StepFailed as e:
        report(spec, step, FAILED, str(e))
        return False
    finally:
        await remote.close()


async def _down_host(spec: str, timeout: float, ssh_config: Path | None, report: Report) -> bool:
    try:
        remote = await ssh.connect(spec, timeout, ssh_config)
    except ssh.SshError as e:
        report(spec, "ssh", FAILED, str(e))
        return False
    try:
        system = (await _must(remote, "uname -s", "uname")).strip()
        if system == "Darwin":
            domain = 'gui/"$(id -u)"'
            path = f"{AGENTS}/{LABEL}.plist"
            if (await remote.run(f"launchctl print {domain}/{LABEL}")).returncode == 0:
                await _must(remote, f"launchctl bootout {domain}/{LABEL}", "launchctl bootout")
                await remote.run(f"rm -f {path}")
                report(spec, "job", DONE, f"launchd job {LABEL} unloaded and removed")
            else:
                await remote.run(f"rm -f {path}")
                report(spec, "job", UNCHANGED, f"launchd job {LABEL} not loaded")
            return True
        home = (await _must(remote, f"echo {DATA_HOME}", "reading the home")).strip()
        pid = await _running_join(remote, home)
        if not pid:
            report(spec, "job", UNCHANGED, "join not running (Linux: nohup, no launchd)")
            return True
        await _stop_pid(remote, home, pid)
        report(spec, "job", DONE, f"join (pid {pid}) stopped")
        return True
    except StepFailed as e:
        report(spec, "job", FAILED, str(e))
        return False
    finally:
        await remote.close()


async def up(specs: list[str], options: UpOptions, report: Report) -> bool:
    """Brings every host up at once; True when every one of them got through."""
    here = checks.versions_check().detail
    return all(await asyncio.gather(*(_up_host(s, options, here, report) for s in specs)))


async def down(specs: list[str], timeout: float, ssh_config: Path | None,
               report: Report) -> bool:
    return all(await asyncio.gather(*(_down_host(s, timeout, ssh_config, report)
                                      for s in specs)))
