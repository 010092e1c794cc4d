"""The `omlx-cluster` command line: help that explains every flag, and clear, quick failures."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omlx_cluster.parser import build_parser
from tests.conftest import alive, descendants, free_port
from tests.helpers.cli import parse_cli

SCRIPT = Path(sys.executable).parent / "omlx-cluster"


def _cmd() -> list[str]:
    """The installed console script (what users run), else the module."""
    if SCRIPT.exists():
        return [str(SCRIPT)]
    found = shutil.which("omlx-cluster")
    return [found] if found else [sys.executable, "-m", "omlx_cluster"]


def run_cli(*args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home), COLUMNS="100")
    return subprocess.run([*_cmd(), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def test_top_level_help(home: Path) -> None:
    r = run_cli("--help", home=home)
    assert r.returncode == 0, r.stderr
    for word in ("serve", "node", "models", "OMLX_CLUSTER_HOME", "OpenAI"):
        assert word in r.stdout, word
    v = run_cli("--version", home=home)
    assert v.returncode == 0 and "omlx-cluster" in v.stdout


@pytest.mark.parametrize("argv, level", [
    ("models list --log-level debug", "debug"), ("models --log-level debug list", "debug"),
    ("models --log-level warning unload m", "warning"), ("models list", "info")])
def test_log_level_before_or_after_a_nested_action(argv: str, level: str) -> None:
    assert build_parser().parse_args(argv.split()).log_level == level


def test_no_command_is_a_usage_error(home: Path) -> None:
    r = run_cli(home=home)
    assert r.returncode == 2
    assert "usage:" in r.stderr and "COMMAND" in r.stderr


@pytest.mark.parametrize("command, key_flags", [
    (["serve"], ["--model", "--model-id", "--host", "--port", "--keepalive", "--prefill-chunk",
                 "--max-batch", "--request-timeout", "--default-max-tokens",
                 "--node-metrics-port", "--log-level", "--nodes", "--split", "--micro-batches",
                 "--backend"]),
    (["plan"], ["--model", "--node", "--split", "--os-reserve", "--context", "--sequences",
                "--json"]),
    (["status"], ["--url", "--json"]),
    (["coordinator"], ["--model", "--host", "--port", "--api-key", "--secret", "--os-reserve",
                       "--no-discovery", "--backend"]),
    (["join"], ["--secret", "--host", "--port", "--name", "--coordinator", "--no-announce"]),
    (["node"], ["--host", "--port", "--ready-file", "--data-port", "--metrics-port", "--model",
                "--exit-with-parent", "--prefill-chunk", "--max-batch"]),
    (["models"], []),
    (["models", "import-gguf"], ["--dest"]),
    (["models", "list"], []),
    (["models", "pull-default"], []),
])
def test_subcommand_help_explains_every_flag(command: list[str], key_flags: list[str],
                                             capsys, monkeypatch) -> None:
    r = parse_cli(*command, "--help", capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    help_text = r.stdout
    assert help_text.startswith("usage: omlx-cluster " + " ".join(command))
    for flag in key_flags:
        assert flag in help_text, flag

    parser = build_parser()
    for name in command:
        parser = _subparsers(parser)[name]
    for action in _flags(parser):
        assert action.help, f"{' '.join(command)} {action.option_strings} has no help"
        for opt in action.option_strings:
            assert opt in help_text, opt
    # Flags with a default say what it is.
    for action in _flags(parser):
        if action.default not in (None, False, argparse.SUPPRESS) and action.dest != "help":
            assert "default" in (action.help or "").lower(), (
                f"{action.option_strings} does not state its default {action.default!r}")
    if command == ["models"]:
        for sub in ("list", "import-gguf", "pull-default"):
            assert sub in help_text


@pytest.mark.slow
def test_serve_missing_model_fails_fast_and_starts_nothing(home: Path) -> None:
    port = free_port()
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home))
    t0 = time.monotonic()
    proc = subprocess.Popen([*_cmd(), "serve", "--model", "/nonexistent/model", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    seen: set[int] = set()
    try:
        while proc.poll() is None and time.monotonic() - t0 < 30:
            seen |= descendants(proc.pid)  # any node it might spawn
            time.sleep(0.02)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    elapsed = time.monotonic() - t0
    assert proc.returncode not in (0, None), (out, err)
    assert elapsed < 30, f"took {elapsed:.1f}s to notice a missing model"
    assert "/nonexistent/model" in err and "error" in err.lower()
    assert "Traceback" not in err, err
    assert not seen, f"started processes {seen} for a model that does not exist"
    with socket.socket() as s:  # nothing listens on the port
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert not any(alive(p) for p in seen)


def test_serve_folder_that_is_not_a_model(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    r = run_cli("serve", "--model", str(folder), "--port", str(free_port()), home=home,
                timeout=30)
    assert r.returncode != 0
    assert str(folder) in r.stderr and "safetensors" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_serve_model_that_fails_to_load_exits_with_the_reason(home: Path, tmp_path: Path,
                                                              tiny_model_path: Path) -> None:
    """Weights cut short after an intact header: the plan (headers only) passes, the node's
    load error reaches the user and serve exits 1 (rather than idling with /health at 503),
    leaving no node process behind."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_path, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    weights.write_bytes(data[:header_end + 1000])
    env = dict(os.environ, OMLX_CLUSTER_HOME=str(home))
    proc = subprocess.Popen([*_cmd(), "serve", "--model", str(broken), "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: set[int] = set()
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < 60:
        seen |= descendants(proc.pid)
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 1, (out, err)
    assert f"could not serve {broken}" in err and "corrupt file" in err, err[-1500:]
    assert seen and not any(alive(p) for p in seen)


@pytest.mark.parametrize("args, words", [
    (["serve", "--port", "eighty"], ["--port", "a port is a number"]),
    (["serve", "--prefill-chunk", "0"], ["--prefill-chunk", "at least 1"]),
    (["serve", "--max-batch", "-3"], ["--max-batch", "at least 1"]),
    (["serve", "--log-level", "loud"], ["--log-level", "invalid choice"]),
    (["serve", "--no-such-flag"], ["unrecognized arguments", "--no-such-flag"]),
    (["node", "--port", "x"], ["--port"]),
    (["models", "import-gguf"], ["file"]),
])
def test_bad_flags_are_usage_errors(args: list[str], words: list[str], capsys,
                                    monkeypatch) -> None:
    r = parse_cli(*args, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 2, (r.stdout, r.stderr)
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert "Traceback" not in r.stderr


def test_models_list_on_an_empty_store(home: Path) -> None:
    r = run_cli("models", "list", home=home, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no models" in r.stdout and "import-gguf" in r.stdout
