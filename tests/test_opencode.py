"""OpenCode (`opencode run`, non-interactive) against a live server over chat completions, on one
node and through a 2-stage pipeline, with no network but the server.

OpenCode is the newest release npm serves (`opencode-ai`, a launcher and a native binary),
installed into the test cache on first use (`python -m tests.test_opencode` does it by hand);
its version is printed with the test's output. Its provider is ours, from an opencode.json in its
config folder (docs/agents.md: OpenCode): `npm: "@ai-sdk/openai-compatible"` (built into the binary,
nothing to install), `baseURL` http://127.0.0.1:PORT/v1, the key from an environment variable
(`{env:...}`), the model with its `limit` (`limit.output` is the max_tokens it sends, 32000
otherwise), `autoupdate` false and `share` disabled. HOME and the XDG folders are temporary.

Offline, measured with OpenCode 1.18.33 and a proxy that logs what it refuses: at start it
fetches https://models.opencode.ai/api.json (models.dev's metadata; failing, it logs an error
and goes on) unless OPENCODE_DISABLE_MODELS_FETCH is set, and in the background it runs npm
(its bundled Arborist, registry.npmjs.org) to install `@opencode-ai/plugin` into each config
folder whose node_modules is missing or whose package-lock.json lacks it (failing, the turn
goes on). The test installs that package once into the test cache with npm and gives each run's
config folder its package.json, package-lock.json and node_modules: then nothing reaches the
proxy.

What OpenCode 1.18.33 sends (tests/data/opencode_chat_body.json, replayed in
tests/test_opencode_body.py): two streamed `POST /v1/chat/completions` for a turn, both with
`stream_options.include_usage`, `max_tokens` from the model's `limit.output`, no temperature:
a title request (its title prompt as the system message, two user messages, no tools) and the
turn (~30 KB: the system prompt ~9.7 KB with the working folder and its one built-in skill,
the user message; 10 function tools: bash, edit, glob, grep, read, skill, task, todowrite,
webfetch, write; `tool_choice: "auto"`). Headers: `authorization: Bearer <key>`,
`user-agent: opencode/1.18.33 ai-sdk/provider-utils/...`, `x-session-id` and
`x-session-affinity` (its session id). It reads `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.agent_clients import (
    ONE_NODE_AND_PIPELINE,
    TURN_TIMEOUT,
    build_agent_model,
    install_cli,
    npm_package,
    offline_env,
)
from tests.conftest import Server, start_server
from tests.recording_proxy import recording_proxy
from tests.refusing_proxy import refusing_proxy

pytestmark = pytest.mark.slow

PACKAGE = "opencode-ai"
PLUGIN = "@opencode-ai/plugin"  # what OpenCode installs into every config folder
KEY = "sk-opencode-test"
KEY_ENV = "OMLX_API_KEY"
CONTEXT_LIMIT, OUTPUT_LIMIT = 65536, 4096


def opencode_config(base_url: str, model: str) -> dict:
    """The opencode.json that points OpenCode at this server (docs/agents.md: OpenCode)."""
    return {"$schema": "https://opencode.ai/config.json",
            "autoupdate": False, "share": "disabled",
            "provider": {"omlx": {"npm": "@ai-sdk/openai-compatible", "name": "omlx-cluster",
                                  "options": {"baseURL": base_url,
                                              "apiKey": f"{{env:{KEY_ENV}}}"},
                                  "models": {model: {"limit": {"context": CONTEXT_LIMIT,
                                                               "output": OUTPUT_LIMIT}}}}},
            "model": f"omlx/{model}"}


def install_opencode() -> tuple[Path, str, Path]:
    """(the CLI, its version, the npm prefix holding its plugin package at that version)."""
    cli, version = install_cli(PACKAGE, "opencode", "opencode")
    return cli, version, npm_package(PLUGIN, version, "opencode-plugin")


@pytest.fixture(scope="module")
def opencode() -> tuple[Path, str, Path]:
    try:
        return install_opencode()
    except RuntimeError as e:
        pytest.skip(f"OpenCode is not available: {e}")


@pytest.fixture(scope="module")
def oc_model(opencode: tuple[Path, str, Path], tmp_path_factory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("models") / "tiny-opencode")


@pytest.fixture(scope="module", **ONE_NODE_AND_PIPELINE)
def oc_server(request, oc_model: Path, tmp_path_factory):
    with start_server(oc_model, "--api-key", KEY, "--nodes", str(request.param),
                      home=tmp_path_factory.mktemp("home")) as s:
        yield s


def _config_folder(folder: Path, plugin: Path, config: dict) -> None:
    """OpenCode's config folder as it leaves it once it has installed its plugin package, so it
    installs nothing (see the module docstring)."""
    folder.mkdir(parents=True)
    (folder / "opencode.json").write_text(json.dumps(config, indent=2))
    for name in ("package.json", "package-lock.json"):
        shutil.copy(plugin / name, folder / name)
    (folder / "node_modules").symlink_to(plugin / "node_modules")


@pytest.mark.timeout(TURN_TIMEOUT + 300)
def test_opencode_run_turn(opencode: tuple[Path, str, Path], oc_server: Server, tmp_path: Path,
                           capsys: pytest.CaptureFixture) -> None:
    cli, version, plugin = opencode
    with capsys.disabled():  # which release passed (or failed) is the point of the run
        print(f"\nOpenCode {version}")
    work = tmp_path / "work"
    work.mkdir()
    with recording_proxy(oc_server.url) as (url, sent), refusing_proxy() as (proxy, attempts):
        _config_folder(tmp_path / "config" / "opencode", plugin,
                       opencode_config(url + "/v1", oc_server.model_id))
        env = offline_env(tmp_path / "home", proxy, **{
            KEY_ENV: KEY, "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "XDG_STATE_HOME": str(tmp_path / "state")})
        r = subprocess.run([str(cli), "run", "--format", "json", "Say hi."], env=env, cwd=work,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=TURN_TIMEOUT)
    log = oc_server.log_tail(300)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log}"
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert "error" not in [e["type"] for e in events], events
    finish = [e["part"] for e in events if e["type"] == "step_finish"]
    assert finish and finish[-1]["reason"] == "stop", events
    # Its whole system prompt and tools arrived (~8k tokens), and it read our usage.
    assert finish[-1]["tokens"]["input"] + finish[-1]["tokens"]["cache"]["read"] > 5000, finish
    assert attempts == [], attempts  # nothing but our server was asked
    posts = [(x.method, x.path, x.status) for x in sent]
    assert posts and set(posts) == {("POST", "/v1/chat/completions", 200)}, posts
    assert all(json.loads(x.body)["max_tokens"] == OUTPUT_LIMIT for x in sent)
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log, log
    assert not re.search(r'HTTP/1\.1" 4\d\d', log), log
    assert "Traceback" not in log


if __name__ == "__main__":
    try:
        print(*install_opencode())
    except RuntimeError as e:
        raise SystemExit(f"OpenCode is not available: {e}") from None
