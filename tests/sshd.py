"""A real OpenSSH server on a loopback port, for the tests of `doctor`, `up` and `down`.

Debian's openssh-server (`apt-get install openssh-server`; .ci/run installs it) runs as root
with a host key, an authorized client key and every other file of its own in a temporary
folder. Its sessions get OMLX_CLUSTER_HOME in that folder too (sshd's SetEnv), so the remote
side, this same machine, never touches the real ~/.omlx-cluster. The client side is an OpenSSH
client config (`--ssh-config`) naming hosts that reach it, as a user's ~/.ssh/config would:
"mac-a" and "mac-b" (two names for the one server, so two "Macs"), "wrong-key" (a key it does
not authorize), "closed" (a port nothing listens on) and "silent" (a port that accepts and never
speaks SSH).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
REMOTE_COMMAND = str(Path(sys.executable).with_name("omlx-cluster"))  # the venv's, remotely too


def skip_unless_sshd() -> None:
    if os.geteuid() != 0:
        pytest.skip("a test sshd needs root (it logs in as root, with UsePAM no)")
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        pytest.skip("no OpenSSH server: apt-get install openssh-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P + 1 both free, below Linux's ephemeral range (32768 and up): a
    connection made meanwhile (the doctor's own SSH clients) is never given P + 1 by the kernel,
    as it can be a port next to one `free_port` returned."""
    start = random.randrange(20000, 32000, 2)
    for p in [*range(start, 32000, 2), *range(20000, start, 2)]:
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports between 20000 and 32000")


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class Sshd:
    root: Path  # its temporary folder
    port: int
    config: Path  # the client's OpenSSH config
    remote_home: Path  # OMLX_CLUSTER_HOME of its sessions
    silent: socket.socket  # keeps the "silent" port open

    def ssh_args(self) -> list[str]:
        return ["--ssh-config", str(self.config), "--remote-command", REMOTE_COMMAND]


def start_sshd(root: Path):
    """Starts sshd under `root`; a generator for a fixture: yields an Sshd, then stops it."""
    skip_unless_sshd()
    root.mkdir(parents=True, exist_ok=True)
    host_pub = _keygen(root / "host_ed25519")
    client_pub = _keygen(root / "id_ed25519")
    _keygen(root / "wrong_ed25519")
    (root / "authorized_keys").write_text(client_pub + "\n")
    remote_home = root / "remote-home"
    port = free_port()
    (root / "sshd_config").write_text(f"""\
ListenAddress 127.0.0.1:{port}
HostKey {root}/host_ed25519
PidFile {root}/sshd.pid
AuthorizedKeysFile {root}/authorized_keys
UsePAM no
StrictModes no
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
SetEnv OMLX_CLUSTER_HOME={remote_home}
MaxStartups 50
LogLevel VERBOSE
""")
    (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    known = f"UserKnownHostsFile {root}/known_hosts"
    (root / "ssh_config").write_text(f"""\
Host mac-a mac-b
  HostName 127.0.0.1
  Port {port}
  User root
  IdentityFile {root}/id_ed25519
  IdentitiesOnly yes
  {known}
Host wrong-key
  HostName 127.0.0.1
  Port {port}
  User root
  IdentityFile {root}/wrong_ed25519
  IdentitiesOnly yes
  {known}
Host closed
  HostName 127.0.0.1
  Port {free_port()}
  User root
Host silent
  HostName 127.0.0.1
  Port {silent.getsockname()[1]}
  User root
""")
    # sshd refuses to start without its privilege separation directory (the Debian service
    # makes it at boot).
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    with open(root / "sshd.log", "wb") as log:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(root / "sshd_config")],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"sshd did not start:\n{(root / 'sshd.log').read_text()}")
            time.sleep(0.1)
    try:
        yield Sshd(root, port, root / "ssh_config", remote_home, silent)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        silent.close()
