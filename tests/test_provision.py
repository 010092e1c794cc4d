"""`omlx-cluster up` / `down` over a real sshd on loopback (tests/sshd.py): they start and stop
a real `join` (with nohup: the test's host is Linux, no launchd) that a real coordinator admits,
and running either twice changes nothing."""

from __future__ import annotations

import os
import plistlib
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from omlx_cluster import provision
from omlx_shared.child import omlx_command
from tests.cluster_secret import SECRET
from tests.sshd import free_port, start_sshd
from tests.stub_http import QuietHandler, stub_server
from tests.tiny_models import build_model

API_KEY = "office-key"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


@pytest.fixture()
def coordinator(tmp_path):
    """A real coordinator on loopback (no Bonjour: the node registers), its secret file and URL."""
    model = build_model(tmp_path / "tiny-up", "llama", num_layers=4)
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    port = free_port()
    with open(tmp_path / "coordinator.log", "wb") as log:
        proc = subprocess.Popen(
            omlx_command("coordinator", "--model", str(model), "--secret-file", str(secret),
                         "--no-discovery", "--host", "127.0.0.1", "--port", str(port),
                         "--api-key", API_KEY),
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMLX_CLUSTER_HOME": str(tmp_path / "coordinator-home")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # a shared machine under load starts it slowly
    while True:
        try:
            httpx.get(f"{url}/health", timeout=2)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"the coordinator did not listen (exit status {proc.poll()}):\n"
                + (tmp_path / "coordinator.log").read_text())
            time.sleep(0.3)
    try:
        yield secret, f"127.0.0.1:{port}", url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(omlx_command(*args), capture_output=True, text=True, timeout=180,
                          env={**os.environ, "COLUMNS": "200"}, check=False)


def steps(out: str) -> dict[str, str]:
    """{step: "outcome detail"} from up/down's lines ("mac-a  secret    done      copied ...")."""
    found = {}
    for line in out.splitlines():
        words = line.split(maxsplit=2)
        if len(words) == 3 and words[0] == "mac-a":
            found[words[1]] = " ".join(words[2].split())
    return found


def status(url: str) -> dict:
    return httpx.get(f"{url}/cluster/status", timeout=5,
                     headers={"authorization": f"Bearer {API_KEY}"}).json()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"


@pytest.mark.slow
def test_up_and_down_start_and_stop_an_admitted_join(sshd, coordinator):
    secret, address, url = coordinator
    node_port, metrics_port = free_port(), free_port()
    up = ["up", "mac-a", *sshd.ssh_args(), "--secret-file", str(secret), "--coordinator",
          address, "--api-key", API_KEY, "--node-port", str(node_port), "--metrics-port",
          str(metrics_port), "--wait", "60"]
    first = cli(*up)
    said = steps(first.stdout)
    assert first.returncode == 0, first.stdout + first.stderr
    assert said["versions"].startswith("done") and "omlx-cluster" in said["versions"]
    assert said["secret"].startswith("done copied to")
    assert said["job"].startswith("done join started with nohup (Linux: no launchd")
    assert said["admitted"].startswith("done admitted as")
    remote_secret = sshd.remote_home / "secret"
    assert remote_secret.read_text().strip() == secret.read_text().strip()
    assert remote_secret.stat().st_mode & 0o777 == 0o600
    pid = int((sshd.remote_home / "join.pid").read_text())
    assert pid_alive(pid)
    node = next(n for n in status(url)["nodes"] if n["address"] == f"127.0.0.1:{node_port}")
    assert node["alive"]

    # The node's own checks of its machine reach the coordinator's status, and `status`.
    deadline = time.monotonic() + 30
    while not node["checks"] and time.monotonic() < deadline:
        time.sleep(0.5)
        node = next(n for n in status(url)["nodes"] if n["id"] == node["id"])
    checks = {c["name"]: c for c in node["checks"]}
    assert checks["macos"] == {"name": "macos", "status": "skip", "detail": "not macOS",
                               "fix": ""}
    assert checks["versions"]["status"] == "pass"
    shown = cli("status", "--url", url, "--api-key", API_KEY)
    assert "checks" in shown.stdout and " ok " in shown.stdout, shown.stdout

    # And doctor now sees it: its ports answer, Bonjour shows it (join announces on loopback).
    seen = cli("doctor", "mac-a", *sshd.ssh_args(), "--check", "ports", "--check", "bonjour",
               "--check", "secret", "--secret-file", str(secret), "--node-port", str(node_port),
               "--metrics-port", str(metrics_port))
    assert f"gRPC {node_port} answers" in seen.stdout, seen.stdout
    assert f"announced as {node['id']}" in seen.stdout, seen.stdout
    assert "the same secret as --secret-file" in seen.stdout, seen.stdout

    # Running up again changes nothing: the same join keeps running.
    again = cli(*up)
    said = steps(again.stdout)
    assert again.returncode == 0, again.stdout + again.stderr
    assert said["secret"].startswith("unchanged") and said["job"].startswith("unchanged")
    assert f"pid {pid}" in said["job"] and said["admitted"].startswith("done admitted as")
    assert int((sshd.remote_home / "join.pid").read_text()) == pid

    down = cli("down", "mac-a", *sshd.ssh_args()[:2])
    assert down.returncode == 0, down.stdout + down.stderr
    assert steps(down.stdout)["job"] == f"done join (pid {pid}) stopped"
    assert not pid_alive(pid) and not (sshd.remote_home / "join.pid").exists()
    deadline = time.monotonic() + 30  # the coordinator notices the node is gone
    while any(n["alive"] for n in status(url)["nodes"] if n["id"] == node["id"]):
        assert time.monotonic() < deadline, status(url)
        time.sleep(0.5)
    again = cli("down", "mac-a", *sshd.ssh_args()[:2])
    assert again.returncode == 0
    assert steps(again.stdout)["job"].startswith("unchanged join not running")


@pytest.mark.slow
def test_up_refuses_a_host_it_cannot_reach(sshd, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    done = cli("up", "wrong-key", *sshd.ssh_args(), "--secret-file", str(secret))
    assert done.returncode == 1
    assert "wrong-key  ssh" in done.stdout and "permission denied" in done.stdout
    # A host without the same omlx-cluster is left alone, saying what to install.
    done = cli("up", "mac-a", *sshd.ssh_args(), "--remote-command", "/nowhere/omlx-cluster",
               "--secret-file", str(secret))
    said = steps(done.stdout)
    assert done.returncode == 1 and said["versions"].startswith("failed `/nowhere/omlx-cluster`")
    assert "secret" not in said  # nothing after the versions


def test_the_launchd_job_is_the_template_filled_in():
    """What `up` installs on a Mac (launchd itself cannot run here): deploy/launchd's job with
    this node's join command line, the secret in its 0600 file rather than in the plist."""
    options = provision.UpOptions(secret="s", coordinator="10.0.0.1:8000", node_port=50051,
                                  metrics_port=9200)
    argv = provision.join_arguments(["/Users/a/omlx/.venv/bin/omlx-cluster"], "10.0.0.7",
                                    "/Users/a/.omlx-cluster", options)
    assert argv == ["/Users/a/omlx/.venv/bin/omlx-cluster", "join", "--host", "10.0.0.7",
                    "--metrics-port", "9200", "--port", "50051", "--secret-file",
                    "/Users/a/.omlx-cluster/secret", "--coordinator", "10.0.0.1:8000"]
    job = plistlib.loads(provision.launchd_plist(argv, "/Users/a/.omlx-cluster", False))
    template = plistlib.loads(provision.TEMPLATE.read_bytes())
    assert job["Label"] == template["Label"] == provision.LABEL
    assert job["ProgramArguments"] == argv
    assert "EnvironmentVariables" not in job  # no secret in the plist
    assert (job["KeepAlive"], job["RunAtLoad"], job["ProcessType"]) == (True, True, "Interactive")
    with_home = plistlib.loads(provision.launchd_plist(argv, "/srv/omlx", True))
    assert with_home["EnvironmentVariables"] == {"OMLX_CLUSTER_HOME": "/srv/omlx"}


class _SlowAdmission(QuietHandler):
    """A coordinator that lists the node only from its fourth /cluster/status on."""

    asked = 0

    def do_GET(self) -> None:
        type(self).asked += 1
        nodes = ([{"id": "mac-a", "address": "10.0.0.7:50051", "alive": True, "layers": [0, 4]}]
                 if self.asked > 3 else [])
        self.send_json(200, {"nodes": nodes})


def test_waiting_for_the_admission_says_how_long_it_has_waited(monkeypatch):
    """The admission step can take minutes (a model loading): `up` says every few seconds
    that it still waits and why, rather than sit silent."""
    import asyncio

    monkeypatch.setattr(provision, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(provision, "ADMISSION_POLL_SECONDS", 0.01)
    said: list[str] = []
    with stub_server(_SlowAdmission) as url:
        options = provision.UpOptions(secret="s", coordinator=url.removeprefix("http://"),
                                      node_port=50051, wait=30)
        outcome = asyncio.run(provision._admitted("10.0.0.7", options, said.append))
    assert outcome == (provision.DONE, "admitted as mac-a, layers [0, 4)")
    assert len(said) == 3 and all(s.startswith("not a member yet after ") for s in said)
    assert said[-1].endswith("(waiting up to 30 s)")
