"""`omlx-cluster doctor` against a real sshd on loopback (tests/sshd.py), the two-rank link
probe between two local ranks, and `doctor` with no host (this machine, no SSH)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from omlx_shared.child import omlx_command
from omlx_shared.link_probe import ProbeError, run_rank
from tests.cluster_secret import SECRET
from tests.sshd import free_port, free_port_pair, start_sshd

MAC_ONLY = {"macos", "thunderbolt", "rdma", "wired-limit", "sleep", "firewall"}


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    yield from start_sshd(tmp_path_factory.mktemp("sshd"))


def doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(omlx_command("doctor", *args), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"}, check=False)


def by_name(host: dict) -> dict[str, dict]:
    return {c["name"]: c for c in host["checks"]}


@pytest.mark.slow
def test_doctor_checks_two_hosts_over_ssh(sshd, model, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    probe_port = free_port_pair()  # rank 0 listens on it, rank 1 on the next
    done = doctor("mac-a", "mac-b", *sshd.ssh_args(), "--json", "--secret-file", str(secret),
                  "--probe-port", str(probe_port), "--model", str(model))
    body = json.loads(done.stdout)
    assert [h["host"] for h in body["hosts"]] == ["mac-a", "mac-b"], done.stderr
    # The model planned over the two hosts' memory: each disk check judges its own shard.
    assert [s["host"] for s in body["plan"]["stages"]] == ["mac-a", "mac-b"]
    assert body["plan"]["stages"][0]["layers"][0] == 0
    for host in body["hosts"]:
        assert (host["address"], host["system"], host["error"]) == ("127.0.0.1", "Linux", "")
        checks = by_name(host)
        # The Mac-only checks say so on this Linux host rather than fail.
        assert {n for n, c in checks.items() if c["detail"] == "not macOS"} == MAC_ONLY
        assert all(checks[n]["status"] == "skip" for n in MAC_ONLY)
        assert checks["versions"]["status"] == "pass", checks["versions"]
        assert checks["versions"]["detail"].startswith("omlx-cluster ")
        assert checks["memory"]["status"] == "pass" and "GiB" in checks["memory"]["detail"]
        assert checks["disk"]["status"] == "pass", checks["disk"]
        assert "the shard's weights" in checks["disk"]["detail"]
        assert checks["clock"]["status"] == "pass", checks["clock"]
        assert checks["ports"]["status"] == "pass", checks["ports"]
        # No join runs there yet: no secret file, nothing announced.
        secret_row = checks["secret"]
        assert secret_row["status"] == "warn" and "up --secret-file" in secret_row["fix"]
        assert checks["bonjour"]["status"] == "warn"
        # A real two-rank probe between the two "Macs": a bandwidth and a latency (whether
        # this shared, loaded machine makes them pass or warn).
        link = checks["link"]
        assert link["status"] in ("pass", "warn"), link
        assert "GB/s" in link["detail"] and "µs one way" in link["detail"]
    assert by_name(body["hosts"][0])["link"]["detail"].startswith("to mac-b: ")
    assert body["ok"] is True and done.returncode == 0

    # The same checks as a table, a section per host, with the fixes.
    table = doctor("mac-a", *sshd.ssh_args(), "--check", "macos", "--check", "versions",
                   "--check", "secret")
    assert table.returncode == 0, table.stderr
    for text in ("mac-a", "127.0.0.1", "macos", "not macOS", "versions", "pass", "secret",
                 "warn", "omlx-cluster up --secret-file F", "1 host(s): 0 fail, 1 warn"):
        assert text in table.stdout, table.stdout


@pytest.mark.slow
def test_a_wrong_key_is_a_clear_auth_failure(sshd):
    done = doctor("wrong-key", *sshd.ssh_args(), "--json")
    host = json.loads(done.stdout)["hosts"][0]
    assert done.returncode == 1 and host["checks"] == []
    assert "permission denied" in host["error"] and "authorized_keys" in host["error"]


@pytest.mark.slow
def test_a_closed_or_silent_port_fails_within_the_timeout(sshd):
    start = time.monotonic()
    done = doctor("closed", "silent", *sshd.ssh_args(), "--json", "--timeout", "2")
    elapsed = time.monotonic() - start
    closed, silent = json.loads(done.stdout)["hosts"]
    assert "connection refused" in closed["error"]
    assert "no SSH answer within 2 s" in silent["error"]
    assert done.returncode == 1
    assert elapsed < 15  # the 2 s timeout plus starting the CLI on a busy machine


def test_doctor_without_hosts_checks_this_machine(model):
    done = doctor("--json", "--model", str(model))
    body = json.loads(done.stdout)
    [stage] = body["plan"]["stages"]  # one machine holds every layer
    assert (stage["host"], stage["layers"]) == ("this machine", [0, 4])
    host = body["hosts"][0]
    assert host["host"] == "this machine" and host["error"] == ""
    checks = by_name(host)
    if host["system"] != "Darwin":
        assert all(checks[n]["detail"] == "not macOS" for n in MAC_ONLY)
    assert checks["versions"]["status"] == "pass"
    # No view from elsewhere.
    assert set(checks) == {"versions", "memory", "disk", "blas"} | MAC_ONLY


def test_link_probe_between_two_local_ranks():
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    other: list = []
    rank1 = threading.Thread(target=lambda: other.append(run_rank(1, peers, timeout=60)))
    rank1.start()
    measured = run_rank(0, peers, timeout=60)
    rank1.join()
    assert other == [None]  # rank 1 only answers
    assert measured is not None and measured.gb_per_s > 0 and measured.latency_us > 0
    assert measured.nbytes == 8 << 20


@pytest.mark.slow
def test_link_probe_fails_clearly_when_the_peer_port_is_closed():
    closed, mine = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ProbeError) as e:
        run_rank(1, [closed, mine], timeout=5)
    assert time.monotonic() - start < 10
    assert f"rank 1 on {mine}: no link with {closed} within 5 s" in str(e.value)

    # The CLI says the same on stderr and exits 1.
    done = subprocess.run(omlx_command("link-probe", "--rank", "1", "--peers",
                                       f"{closed},{mine}", "--timeout", "5"),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and f"no link with {closed} within 5 s" in done.stderr
