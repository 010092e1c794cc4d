"""Claude Code itself (the `claude` CLI) against a live server: a turn in print mode, and a second
turn of the same session whose prompt the prefix cache serves.

What Claude Code 2.1.197 sends (recorded with a capturing server): `HEAD /` first (a
connectivity check; our 404 is fine), then one `POST /v1/messages?beta=true` per round trip
(`num_turns` in its JSON result: one a turn unless the reply calls a tool; none to
count_tokens, no side requests with CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC) with headers
`x-api-key`, `anthropic-version: 2023-06-01`, `anthropic-beta: claude-code-20250219,
interleaved-thinking-2025-05-14, context-management-2025-06-27, prompt-caching-scope-2026-01-05,
mid-conversation-system-2026-04-07, effort-2025-11-24...`, `x-app: cli`. The body: `model`,
`max_tokens` 32000, `stream` true, `system` as three text blocks (a billing-header line, then the
prompt; cache_control on the last two), `tools`: 24 client tools (Agent, Bash, Edit, Read, Write,
WebFetch, WebSearch, Task*, Cron*...) with draft 2020-12 JSON schemas (two use propertyNames,
which llguidance cannot compile: only a forced call would need it), `metadata.user_id` (JSON
text), `thinking` {"type": "adaptive"}, `context_management` (a clear_thinking edit),
`output_config` {"effort": "high"}; no temperature. The messages: the user turn (a
<system-reminder> text block, then the prompt with cache_control) followed by a `system`
message (the mid-conversation-system beta: the agents and skills available). The next turn
(--resume) sends the same system prompt and tools byte for byte and the earlier turns with the
reply, so its prompt extends the first turn's and the prefix cache serves nearly all of it.
Claude Code takes the cache split from message_delta's usage.

A reply that stops at max_tokens makes Claude Code retry and then fail the turn ("response
exceeded the output token maximum"), so a random model that never ends its turn cannot pass:
the tiny model's config lists one token in 20 as an end of turn (`eos_token_id` is a list, as
Llama 3's is), so its replies end after about 20 tokens.

The prompt is about 77 KB of JSON. A 32k BPE trained on the Python standard library and Claude
Code's own sdk-tools.d.ts makes it ~20.7k tokens (the tests' usual 384-token vocabulary: 60k);
the context is 64k. Measured here (2 shared CPU cores, MLX's reference BLAS, 2 layers, hidden
64): the first turn 22 s, nearly all of it prefill; the second 0.9 s, 20480 of its 20.9k
prompt tokens read from the cache.

The test installs Claude Code with npm into the test cache on first use (`python -m
tests.test_claude_code` does it by hand).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import Server, start_server
from tests.conftest_models import cache_dir
from tests.tiny_models import QWEN_TEMPLATE, build_model

pytestmark = pytest.mark.slow

CLAUDE_CODE_VERSION = "2.1.197"  # the version whose requests the docstring describes
PACKAGE = "@anthropic-ai/claude-code"
KEY = "sk-ant-claude-code-test"
VOCAB = 32768
CONTEXT = 65536
CACHE_BLOCK = 256  # the server's default prefix-cache block
TURN_TIMEOUT = 600  # seconds a turn may take (the first prefills ~20k tokens on a CPU)


def install_claude_code() -> Path:
    """The `claude` CLI in the test cache, installed with npm on first use; RuntimeError says
    why it cannot be."""
    prefix = cache_dir() / "claude-code"
    cli = prefix / "node_modules" / ".bin" / "claude"
    manifest = prefix / "node_modules" / PACKAGE / "package.json"
    if not (manifest.exists() and json.loads(manifest.read_text())["version"]
            == CLAUDE_CODE_VERSION and cli.exists()):
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            raise RuntimeError("node and npm are needed to install Claude Code")
        prefix.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                            f"{PACKAGE}@{CLAUDE_CODE_VERSION}"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"npm install {PACKAGE} failed: {r.stderr[-2000:]}")
    # Its postinstall puts the native binary in place; without it bin/claude is a stub.
    r = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.startswith(CLAUDE_CODE_VERSION):
        raise RuntimeError(f"{cli} --version said: {r.stdout[-500:]}{r.stderr[-1500:]}")
    return cli


@pytest.fixture(scope="module")
def claude() -> Path:
    try:
        return install_claude_code()
    except RuntimeError as e:
        pytest.skip(f"Claude Code is not available: {e}")


@pytest.fixture(scope="module")
def cc_server(claude: Path, tmp_path_factory):
    """A 2-layer Qwen-style model whose tokenizer reads English and code in few tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))]
    sdk_types = claude.resolve().parent.parent / "sdk-tools.d.ts"
    corpus.append(sdk_types.read_text())
    dest = tmp_path_factory.mktemp("models") / "tiny-claude-code"
    build_model(dest, "qwen2", num_layers=2, hidden_size=64, seed=0, vocab_size=VOCAB,
                corpus=corpus, chat_template=QWEN_TEMPLATE,
                extra_config={"max_position_embeddings": CONTEXT,
                              # One token in 20 ends the turn (see the module docstring).
                              "eos_token_id": list(range(VOCAB - VOCAB // 20, VOCAB))})
    with start_server(dest, "--api-key", KEY, home=tmp_path_factory.mktemp("home")) as s:
        yield s


def _turn(claude: Path, server: Server, home: Path, *args: str) -> dict:
    home.mkdir(exist_ok=True)
    (home / "work").mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY,
           "ANTHROPIC_MODEL": server.model_id, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1",
           # No network: anything but our server goes to a proxy that refuses at once.
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost"}
    r = subprocess.run([str(claude), "--output-format", "json", *args], env=env,
                       cwd=home / "work", capture_output=True, text=True, timeout=TURN_TIMEOUT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{server.log_tail()}"
    result = json.loads(r.stdout)
    assert result["type"] == "result" and result["subtype"] == "success", result
    assert not result["is_error"] and result["stop_reason"] == "end_turn", result
    return result


@pytest.mark.timeout(2 * TURN_TIMEOUT + 300)
def test_two_turns_of_a_session(claude: Path, cc_server: Server, tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = _turn(claude, cc_server, home, "-p", "Say hi.")
    # A result's usage sums its round trips (`num_turns`: two when the random model's reply
    # calls a tool), so each prompt is judged per trip.
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    # Claude Code's whole system prompt and tools arrived, in every request
    assert prompt / first["num_turns"] > 15000, usage
    assert usage["output_tokens"] >= 1

    second = _turn(claude, cc_server, home, "-p", "And again.", "--resume", first["session_id"])
    assert second["session_id"] == first["session_id"]
    u = second["usage"]
    again = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    # Each of its requests found all but its last, partial block of the session in the cache.
    assert u["cache_read_input_tokens"] >= (again // CACHE_BLOCK - second["num_turns"]) \
        * CACHE_BLOCK, u
    # One request per round trip Claude Code counts (`num_turns`) and no side requests: a turn
    # takes more than one when the random model's reply happens to call a tool.
    trips = first["num_turns"] + second["num_turns"]
    log = cc_server.log_tail(200)
    assert log.count('"POST /v1/messages?beta=true HTTP/1.1" 200') == trips, (
        log, [{k: v for k, v in r.items() if k != "result"} for r in (first, second)])


if __name__ == "__main__":
    try:
        print(install_claude_code())
    except RuntimeError as e:
        raise SystemExit(f"Claude Code is not available: {e}") from None
