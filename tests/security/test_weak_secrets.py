"""Issue 49, part 3: a weak cluster secret is refused by every command that takes one, and
`omlx-cluster secret new` makes one that passes. Guesses at the secret can be checked offline
(docs/security.md), so only a random one keeps the cluster closed."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from omlx_shared.auth import SECRET_ENV, new_secret
from omlx_shared.child import omlx_command
from omlx_shared.secret_strength import MIN_BITS, strength_bits, weakness
from tests.cluster_secret import OTHER_SECRET, SECRET
from tests.conftest import free_port

QUICK_SECONDS = 20.0  # the CLI's imports on a loaded 2-core machine; no model, no network


def cli(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    return subprocess.run(omlx_command(*args), capture_output=True, text=True, timeout=60,
                          env={**environ, "OMLX_CLUSTER_HOME": str(home), **(env or {})})


@pytest.mark.parametrize("weak", [
    "s3cret",                                   # short
    "correct horse battery staple",             # four words: ~80 bits
    "password12345678901234",                   # a word and a digit sequence
    "summer2024summer2024!!",                   # a repeat
    "qwertyuiopasdfghjklzxcvbnm",               # a keyboard walk
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",         # a run
])
def test_weak_secrets_are_weak(weak: str) -> None:
    assert weakness(weak) is not None


def test_random_secrets_pass_with_a_margin() -> None:
    """new_secret()'s 43 URL-safe characters: the lowest of a million measured ~140 bits."""
    assert min(strength_bits(new_secret()) for _ in range(3000)) > MIN_BITS + 10
    assert weakness("correct horse battery staple lemon yacht violin kettle") is None


@pytest.mark.parametrize("how", ["--secret", "--secret-file", "env"])
@pytest.mark.parametrize("command", [
    ["coordinator", "--no-discovery"],
    ["join", "--no-announce", "--speed", "1"],
    ["node", "--host", "127.0.0.1"],
])
def test_a_weak_secret_is_refused_at_once(command: list[str], how: str, tmp_path: Path) -> None:
    weak = "the office cluster secret"
    file = tmp_path / "secret"
    file.write_text(weak + "\n")
    file.chmod(0o600)
    given = {"--secret": ["--secret", weak], "--secret-file": ["--secret-file", str(file)],
             "env": []}[how]
    started = time.monotonic()
    r = cli(*command, "--port", str(free_port()), *given, home=tmp_path / "home",
            env={SECRET_ENV: weak} if how == "env" else None)
    assert r.returncode == 2, r.stderr
    assert time.monotonic() - started < QUICK_SECONDS
    assert "too weak" in r.stderr and "omlx-cluster secret new" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "Downloading" not in r.stderr  # refused before any model is fetched


def test_secret_new_prints_a_strong_secret_each_time(tmp_path: Path) -> None:
    first, second = (cli("secret", "new", home=tmp_path) for _ in range(2))
    assert first.returncode == second.returncode == 0, first.stderr
    assert first.stdout != second.stdout
    assert weakness(first.stdout.strip()) is None


def test_secret_new_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "secret"
    r = cli("secret", "new", "--file", str(path), home=tmp_path / "home")
    assert r.returncode == 0 and str(path) in r.stderr and r.stdout == "", r
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    made = path.read_text()

    again = cli("secret", "new", "--file", str(path), home=tmp_path / "home")
    assert again.returncode == 2 and "--force" in again.stderr
    assert path.read_text() == made

    path.chmod(0o644)  # a file replaced with --force ends 0600 whatever it was
    forced = cli("secret", "new", "--file", str(path), "--force", home=tmp_path / "home")
    assert forced.returncode == 0 and path.read_text() != made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.slow  # a `join` that listens
def test_a_secret_from_secret_new_is_accepted(tmp_path: Path) -> None:
    """`join` with it listens (its ready file appears)."""
    path, ready = tmp_path / "secret", tmp_path / "ready.json"
    assert cli("secret", "new", "--file", str(path), home=tmp_path / "home").returncode == 0
    environ = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    with open(tmp_path / "join.log", "wb") as log:
        join = subprocess.Popen(
            omlx_command("join", "--secret-file", str(path), "--no-announce", "--speed", "1",
                         "--port", str(free_port()), "--ready-file", str(ready)),
            stdout=log, stderr=subprocess.STDOUT,
            env={**environ, "OMLX_CLUSTER_HOME": str(tmp_path / "home")})
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and join.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), (tmp_path / "join.log").read_text()
    finally:
        join.terminate()
        join.wait(timeout=30)


def test_up_without_a_secret_file_makes_one_and_keeps_it(tmp_path: Path) -> None:
    """The secret is made before any host is reached; the unreachable host then fails."""
    home = tmp_path / "home"
    args = ("up", f"nobody@127.0.0.1:{free_port()}", "--timeout", "2")
    first = cli(*args, home=home)
    path = home / "secret"
    assert f"--secret-file {path}" in first.stderr, first.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    made = path.read_text()
    assert weakness(made.strip()) is None
    second = cli(*args, home=home)
    assert path.read_text() == made and "made a new cluster secret" not in second.stderr


def test_strong_test_secrets() -> None:
    assert weakness(SECRET) is None and weakness(OTHER_SECRET) is None
