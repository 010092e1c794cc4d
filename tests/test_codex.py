"""OpenAI's Codex CLI (`codex exec`, non-interactive) against a live server over the Responses API,
on one node and through a 2-stage pipeline.

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

The model is the tiny random one of tests/agent_clients.py (a 32k BPE; one token in 20 ends
the turn, so a reply ends after about 20 tokens and Codex finishes the turn).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.agent_clients import (
    CONTEXT,
    ONE_NODE_AND_PIPELINE,
    TURN_TIMEOUT,
    build_agent_model,
    install_cli,
    offline_env,
)
from tests.conftest import Server, start_server

pytestmark = pytest.mark.slow

PACKAGE = "@openai/codex"
KEY = "sk-codex-test"
KEY_ENV = "OMLX_API_KEY"


def codex_config(base_url: str, model: str) -> str:
    """The config.toml that points Codex at this server (docs/agents.md: Codex CLI)."""
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


@pytest.fixture(scope="module")
def codex() -> tuple[Path, str]:
    """(the CLI, its version)."""
    try:
        return install_cli(PACKAGE, "codex", "codex")
    except RuntimeError as e:
        pytest.skip(f"Codex CLI is not available: {e}")


@pytest.fixture(scope="module")
def codex_model(codex: tuple[Path, str], tmp_path_factory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("models") / "tiny-codex")


@pytest.fixture(scope="module", **ONE_NODE_AND_PIPELINE)
def codex_server(request, codex_model: Path, tmp_path_factory):
    with start_server(codex_model, "--api-key", KEY, "--nodes", str(request.param),
                      home=tmp_path_factory.mktemp("home")) as s:
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
    env = offline_env(tmp_path, CODEX_HOME=str(home), **{KEY_ENV: KEY})
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
    # Its whole prompt arrived. The reply may be empty: its first token ends the turn one time
    # in 20 (measured: 1 of 40), and Codex finishes that turn as it should.
    assert usage["input_tokens"] > 5000, usage
    assert '"POST /v1/responses HTTP/1.1" 200' in log, log
    assert not re.search(r'HTTP/1\.1" 4\d\d', log), log
    assert "Traceback" not in log


if __name__ == "__main__":
    try:
        print(*install_cli(PACKAGE, "codex", "codex"))
    except RuntimeError as e:
        raise SystemExit(f"Codex CLI is not available: {e}") from None
