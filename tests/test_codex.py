"""OpenAI's Codex CLI (`codex exec`, non-interactive) against a live server over the Responses API.

Codex is the newest release npm serves, installed into the test cache on first use (`python -m
tests.test_codex` does it by hand); its version is printed with the test's output. Its model
provider is ours: `base_url` http://127.0.0.1:PORT/v1, `wire_api = "responses"`, the key from an
environment variable (`env_key`), no retries (a failure shows at once), and Codex's defaults
otherwise: its built-in `web_search` tool comes in every request and is left out of the prompt.
CODEX_HOME is a temporary folder holding that config.toml; anything but our
server goes to a proxy that refuses at once.

What Codex 0.171.0 sends (tests/data/codex_responses_body.json, recorded with a capturing
server; replayed in tests/test_responses_api.py): one streamed `POST /v1/responses` a turn,
~41 KB: no `instructions`; `input` as message items, two `developer` ones (its system prompt,
~18 KB, and its skills) and two `user` ones (the environment context, the prompt), each with an
`id`; 8 tools, 7 function tools (`exec_command`, `write_stdin`, `request_user_input`,
`view_image`, goals) with `strict: false` and a `namespace` tool `multi_agent_v1` grouping 5
more; `tool_choice: "auto"`, `parallel_tool_calls: true`, `reasoning: {"summary": "auto"}`,
`store: false`, `stream: true`, `include: ["reasoning.encrypted_content"]`, `prompt_cache_key`
(its session id) and `client_metadata` (a field no SDK type declares). Headers: `authorization:
Bearer <key>`, `originator: codex_exec`, `session-id`, `x-codex-turn-metadata`. It reads
`response.output_text.delta`, `response.output_item.done` and `response.completed` (with usage).

The model is the tiny random one of tests/test_claude_code.py (a 32k BPE; one token in 20 ends
the turn, so a reply ends after about 20 tokens and Codex finishes the turn).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import Server, start_server
from tests.conftest_models import cache_dir
from tests.tiny_models import QWEN_TEMPLATE, build_model

pytestmark = pytest.mark.slow

PACKAGE = "@openai/codex"
KEY = "sk-codex-test"
KEY_ENV = "OMLX_API_KEY"
VOCAB = 32768
CONTEXT = 65536
TURN_TIMEOUT = 600  # seconds a turn may take (its first prefill is ~10k tokens on a CPU)


def codex_config(base_url: str, model: str) -> str:
    """The config.toml that points Codex at this server (README: Codex CLI)."""
    return f'''model = "{model}"
model_provider = "omlx"
model_context_window = {CONTEXT}

[model_providers.omlx]
name = "omlx-cluster"
base_url = "{base_url}"
env_key = "{KEY_ENV}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
'''


def install_codex() -> tuple[Path, str]:
    """The `codex` CLI at the newest version npm serves (the one installed when npm cannot be
    asked), in the test cache; RuntimeError says why it cannot be."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("node and npm are needed to install Codex CLI")
    prefix = cache_dir() / "codex"
    cli = prefix / "node_modules" / ".bin" / "codex"
    manifest = prefix / "node_modules" / PACKAGE / "package.json"
    installed = json.loads(manifest.read_text())["version"] if manifest.exists() else None
    r = subprocess.run([npm, "view", PACKAGE, "version"], capture_output=True, text=True,
                       timeout=120)
    newest = r.stdout.strip() if r.returncode == 0 else installed
    if newest is None:
        raise RuntimeError(f"npm view {PACKAGE} failed: {r.stderr[-2000:]}")
    if newest != installed or not cli.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                            f"{PACKAGE}@{newest}"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"npm install {PACKAGE} failed: {r.stderr[-2000:]}")
    # The npm package's launcher runs a native binary from a per-platform package.
    r = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or newest not in r.stdout:
        raise RuntimeError(f"{cli} --version said: {r.stdout[-500:]}{r.stderr[-1500:]}")
    return cli, newest


@pytest.fixture(scope="module")
def codex() -> tuple[Path, str]:
    """(the CLI, its version)."""
    try:
        return install_codex()
    except RuntimeError as e:
        pytest.skip(f"Codex CLI is not available: {e}")


@pytest.fixture(scope="module")
def codex_server(codex: tuple[Path, str], tmp_path_factory):
    """A 2-layer Qwen-style model whose tokenizer reads English and code in few tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))]
    dest = tmp_path_factory.mktemp("models") / "tiny-codex"
    build_model(dest, "qwen2", num_layers=2, hidden_size=64, seed=0, vocab_size=VOCAB,
                corpus=corpus, chat_template=QWEN_TEMPLATE,
                extra_config={"max_position_embeddings": CONTEXT,
                              # One token in 20 ends the turn (see the module docstring).
                              "eos_token_id": list(range(VOCAB - VOCAB // 20, VOCAB))})
    with start_server(dest, "--api-key", KEY, home=tmp_path_factory.mktemp("home")) as s:
        yield s


@pytest.mark.timeout(TURN_TIMEOUT + 300)
def test_codex_exec_turn(codex: tuple[Path, str], codex_server: Server, tmp_path: Path,
                         capsys: pytest.CaptureFixture) -> None:
    cli, version = codex
    with capsys.disabled():  # which release passed (or failed) is the point of the run
        print(f"\nCodex CLI {version}")
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(codex_config(codex_server.url + "/v1",
                                                   codex_server.model_id))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "CODEX_HOME": str(home), KEY_ENV: KEY,
           # No network: anything but our server goes to a proxy that refuses at once.
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost"}
    r = subprocess.run([str(cli), "exec", "--skip-git-repo-check", "--ephemeral", "--json",
                        "-C", str(work), "Say hi."], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=TURN_TIMEOUT)
    log = codex_server.log_tail(300)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log}"
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, \
        events
    usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    assert usage["input_tokens"] > 5000 and usage["output_tokens"] >= 1, usage  # its prompt
    assert '"POST /v1/responses HTTP/1.1" 200' in log, log
    assert not re.search(r'HTTP/1\.1" 4\d\d', log), log
    assert "Traceback" not in log


if __name__ == "__main__":
    try:
        print(*install_codex())
    except RuntimeError as e:
        raise SystemExit(f"Codex CLI is not available: {e}") from None
