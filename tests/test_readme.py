"""The README's first screen, run as written: its commands are parsed out of README.md, so that
a command the README shows cannot stop working without a test failing.

Only what a test cannot give as written is substituted: the host and port (a free loopback
port, not 8000) and the model id (a tiny model, served from a folder or from a hub stand-in on
loopback: no test reaches the real hub)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_shared.hub import is_hub_id
from tests.conftest import REPO, Server, start_server
from tests.hub_stand_in import HubStandIn

README = REPO / "README.md"
README_URL = "http://127.0.0.1:8000"
REPO_ID = "test-org/Tiny-4bit"


def section(title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README.read_text(),
                  re.MULTILINE | re.DOTALL)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def commands(text: str) -> list[list[str]]:
    """The commands of the ```sh blocks of `text`, each as the shell would split it: a line,
    or several where a quote runs on (a curl's JSON body)."""
    found = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        pending = ""
        for line in block.splitlines(keepends=True):
            pending += line
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if argv:
                found.append(argv)
            pending = ""
        assert not pending.strip(), f"unterminated command in README.md: {pending!r}"
    return found


def run_curl(argv: list[str], url: str, model: str) -> dict:
    """Runs the README's curl with only its address and model id replaced."""
    assert argv[0] == "curl"
    body_at = argv.index("-d") + 1
    body = json.loads(argv[body_at])
    argv = [a.replace(README_URL, url) for a in argv]
    argv[body_at] = json.dumps({**body, "model": model})
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply.get("object") == "chat.completion", reply
    assert reply["model"] == model
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert 0 < reply["usage"]["completion_tokens"] <= body["max_tokens"]
    return reply


def quick_start_curl() -> list[str]:
    curls = [c for c in commands(section("First request")) if c[0] == "curl"]
    assert len(curls) == 1, curls
    assert curls[0][1].startswith(README_URL + "/v1/")
    return curls[0]


def test_the_first_screens_commands_parse() -> None:
    """What is not started here (a coordinator and a join need two machines) at least names
    only flags and values the CLI takes."""
    from omlx_cluster.parser import build_parser

    argvs = (commands(section("A real model by its Hugging Face id"))
             + commands(section("A second Mac")))
    assert {tuple(a[:2]) for a in argvs} >= {("omlx-cluster", "serve"),
                                             ("omlx-cluster", "models"),
                                             ("omlx-cluster", "coordinator"),
                                             ("omlx-cluster", "join")}
    for argv in argvs:
        assert argv[0] == "omlx-cluster"
        build_parser().parse_args(argv[1:])  # SystemExit on a flag it does not take
    quick_start_curl()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_quick_start_request(server: Server) -> None:
    run_curl(quick_start_curl(), server.url, server.model_id)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_and_pull_a_hub_id(tiny_model_path: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    argvs = commands(section("A real model by its Hugging Face id"))
    serve = next(a for a in argvs if a[:2] == ["omlx-cluster", "serve"])
    pull = next(a for a in argvs if a[:3] == ["omlx-cluster", "models", "pull"])
    assert serve[2] == "--model" and is_hub_id(serve[3]) and pull[3] == serve[3], (serve, pull)

    hub = HubStandIn()
    try:
        hub.add_folder(REPO_ID, tiny_model_path)
        # An empty Hugging Face cache and a hub that is the stand-in: the server must download.
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)

        with start_server(Path(REPO_ID), *serve[4:], home=tmp_path / "serve-home",
                          timeout=90) as server:
            assert any(m == "GET" and p.endswith("/model.safetensors")
                       for m, p, _ in hub.requests), hub.requests
            # The README says clients send the id itself.
            run_curl(quick_start_curl(), server.url, REPO_ID)

        hub.requests.clear()
        home = tmp_path / "pull-home"
        r = subprocess.run([sys.executable, "-m", "omlx_cluster", *pull[1:3], REPO_ID],
                           capture_output=True, text=True, timeout=90, cwd=REPO, check=False,
                           env={**os.environ, "OMLX_CLUSTER_HOME": str(home)})
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"{REPO_ID} ready at {home / 'models' / 'test-org--Tiny-4bit'}" in r.stdout
        assert any(m == "GET" and p.endswith("/model.safetensors")
                   for m, p, _ in hub.requests), hub.requests
    finally:
        hub.close()
