"""Prompts at rest (issue 49, part 2): what the service writes (KV blocks, weights, keys, logs)
is 0600 in 0700 folders, and a home an older version left readable by others is fixed at start."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import httpx
import pytest

from omlx_shared.private_files import (
    PrivateFileError,
    keep_private,
    private_opener,
    read_private,
    tighten,
    write_private,
)
from tests.conftest import start_server


@pytest.fixture
def umask():
    """keep_private sets this process's umask: give the test runner its own back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def open_to_others(*roots: Path) -> list[str]:
    """Every file and folder under `roots` with a group or other bit, links not followed."""
    paths = [p for root in roots for p in [str(root), *(
        os.path.join(folder, n) for folder, dirs, files in os.walk(root) for n in dirs + files)]]
    found = []
    for p in paths:
        st = os.lstat(p)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            found.append(f"{p} ({stat.S_IMODE(st.st_mode):o})")
    return found


def old_home(home: Path) -> dict[str, Path]:
    """A home as older versions left it: folders 0755, files 0644."""
    paths = {"block": home / "kv-cache" / "m.0123abcd" / "0-4" / "ab" / "ab12.safetensors",
             "weights": home / "models" / "tiny@0123456789ab" / "model.safetensors",
             "key": home / "node-key", "log": home / "logs" / "node-1.log"}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
        p.chmod(0o644)
    for folder in {q for p in paths.values() for q in p.parents if home in q.parents or q == home}:
        folder.chmod(0o755)
    return paths


def test_a_home_left_open_is_fixed_at_start_with_one_log_line(tmp_path, umask, caplog):
    home = tmp_path / "home"
    paths = old_home(home)
    outside = tmp_path / "mine.safetensors"  # a user's model linked into the store: not ours
    outside.write_text("x")
    outside.chmod(0o644)
    (home / "models" / "linked.safetensors").symlink_to(outside)
    with caplog.at_level(logging.INFO, logger="omlx_shared.private_files"):
        keep_private(home)
    assert open_to_others(home) == []
    assert stat.S_IMODE(paths["block"].stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert f"under {home.resolve()} private" in lines[0] and "(644)" in lines[0]
    assert "(755)" in lines[0] and "more" in lines[0]  # 4 files and 8 folders: 3 named

    # New files are private whatever code writes them, and a second start has nothing to say.
    (home / "kv-cache" / "new").mkdir()
    (home / "kv-cache" / "new" / "block").write_text("x")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omlx_shared.private_files"):
        keep_private(home)
    assert open_to_others(home) == [] and caplog.records == []


def test_a_home_that_holds_the_users_home_is_left_alone(tmp_path, umask, caplog, monkeypatch):
    monkeypatch.setattr(Path, "home", lambda: tmp_path / "me")
    (tmp_path / "me" / "Public").mkdir(parents=True)
    (tmp_path / "me" / "Public").chmod(0o755)
    with caplog.at_level(logging.INFO, logger="omlx_shared.private_files"):
        keep_private(tmp_path / "me")
    assert stat.S_IMODE((tmp_path / "me" / "Public").stat().st_mode) == 0o755
    assert "holds your home folder" in caplog.text


def test_tighten_leaves_what_it_cannot_reach(tmp_path):
    assert tighten(tmp_path / "missing") == []
    f = tmp_path / "f"
    f.write_text("x")
    f.chmod(0o640)
    assert tighten(f) == [(f, 0o640)] and stat.S_IMODE(f.stat().st_mode) == 0o600


def test_private_writes_are_0600_whatever_the_umask(tmp_path, umask):
    os.umask(0o022)  # a process that did not start through the CLI
    target = tmp_path / "new" / "usage.json"
    write_private(target, "{}")
    write_private(target, b"{\"days\": {}}")  # a replace keeps it private
    assert target.read_text() == '{"days": {}}'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert [p.name for p in target.parent.iterdir()] == ["usage.json"]  # no temporary left
    part = tmp_path / "model.safetensors.part"
    with open(part, "wb", opener=private_opener) as f:
        f.write(b"x")
    assert stat.S_IMODE(part.stat().st_mode) == 0o600


def test_a_failed_private_write_leaves_the_old_file_and_no_temporary(tmp_path, umask):
    target = tmp_path / "node-key"
    write_private(target, "old\n")
    with pytest.raises(TypeError):
        write_private(target, 42)  # nothing to write: the replace never happens
    assert target.read_text() == "old\n" and list(tmp_path.iterdir()) == [target]


def test_a_private_file_readable_by_others_is_refused_with_the_fix(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k1\n")
    f.chmod(0o644)
    with pytest.raises(PrivateFileError, match=f"API key file {f} is readable by other users "
                                                rf"\(mode 644\): `chmod 600 {f}`"):
        read_private(f, "API key")
    f.chmod(0o600)
    assert read_private(f, "API key") == "k1"


@pytest.mark.slow
def test_nothing_the_server_writes_is_open_to_others(tiny_model_path, tmp_path):
    """A real chat through `serve` over its self-signed TLS: its home (made 0755 by the test, as
    an older version would have) and an SSD cache folder elsewhere hold KV blocks, logs, usage
    and the TLS key, all private; a --log-file left 0644 is made 0600."""
    home, cache = tmp_path / "home", tmp_path / "kv-elsewhere"
    log_file = tmp_path / "gateway.log"
    log_file.write_text("")
    log_file.chmod(0o644)
    with start_server(tiny_model_path, "--cache-block-size", "16", "--paged-ssd-cache-dir",
                      str(cache), "--tls", "self-signed", "--log-file", str(log_file), home=home,
                      keepalive=None, scheme="https") as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, verify=False, json={
            "model": server.model_id, "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "system", "content": "You are a careful assistant. " * 10},
                {"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        tail = server.log_tail(200)
    assert list(cache.rglob("*.safetensors")), "no KV block reached the SSD tier"
    assert list(home.rglob("*.log")) and (home / "logs").is_dir()
    for written in ("usage.json", "gateway-tls/key.pem", "gateway-tls/cert.pem"):
        assert (home / written).is_file(), f"{written} was not written: {sorted(home.rglob('*'))}"
    assert "/v1/chat/completions" in log_file.read_text()  # the access log, client data
    assert open_to_others(home, cache, log_file) == []
    assert f"under {home.resolve()} private" in tail  # the 0755 home the test made, fixed
