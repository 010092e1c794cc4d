"""Claude Code itself (the `claude` CLI) against a live server, at the newest release npm serves
and at the oldest we promise (2.1.197): a turn in print mode, and a second turn of the same
session whose prompt the prefix cache serves; no request refused on the way, and the tool it
defers (`defer_loading`) left out of the prompt.

Since 2.1.3xx it also sends `thinking.display`, `context_management` edits with `keep`, a
`DeferredToolPlaceholder` tool with `defer_loading: true` beside its own ToolSearch tool (the
rest of its deferred tools are named in the mid-conversation system message), and the
mid-conversation-tool-changes beta; no `HEAD /` (tests/data/claude_code_2.1.332_messages.json is
its first request as recorded).

What Claude Code 2.1.197 sends (recorded with a capturing server): `HEAD /` first (a
connectivity check, answered 200 by `/`), then one `POST /v1/messages?beta=true` per round trip
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
tests.test_claude_code` does it by hand), the newest as `npm view` names it then.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import httpx
import pytest

from omlx_coordinator.api.anthropic_schema import PromptBody
from tests.conftest import Server, start_server
from tests.conftest_models import cache_dir
from tests.recording_proxy import Exchange, recording_proxy
from tests.tiny_models import QWEN_TEMPLATE, build_model

pytestmark = pytest.mark.slow

OLDEST = "2.1.197"  # the oldest release we promise to serve
PACKAGE = "@anthropic-ai/claude-code"
KEY = "sk-ant-claude-code-test"
VOCAB = 32768
CONTEXT = 65536
CACHE_BLOCK = 256  # the server's default prefix-cache block
TURN_TIMEOUT = 600  # seconds a turn may take (the first prefills ~20k tokens on a CPU)


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("node and npm are needed to install Claude Code")
    return npm


def newest_version() -> str:
    """The newest release npm serves now."""
    r = subprocess.run([_npm(), "view", PACKAGE, "version"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"npm view {PACKAGE} failed: {r.stderr[-2000:]}")
    return r.stdout.strip()


def install_claude_code(version: str) -> Path:
    """The `claude` CLI of `version` in the test cache, installed with npm on first use;
    RuntimeError says why it cannot be."""
    prefix = cache_dir() / f"claude-code-{version}"
    cli = prefix / "node_modules" / ".bin" / "claude"
    manifest = prefix / "node_modules" / PACKAGE / "package.json"
    if not (manifest.exists() and json.loads(manifest.read_text())["version"] == version
            and cli.exists()):
        prefix.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([_npm(), "install", "--no-audit", "--no-fund", "--prefix",
                            str(prefix), f"{PACKAGE}@{version}"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"npm install {PACKAGE}@{version} failed: {r.stderr[-2000:]}")
    # Its postinstall puts the native binary in place; without it bin/claude is a stub.
    r = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.startswith(version):
        raise RuntimeError(f"{cli} --version said: {r.stdout[-500:]}{r.stderr[-1500:]}")
    return cli


@pytest.fixture(scope="module", params=["newest", OLDEST])
def claude(request) -> Path:
    try:
        version = newest_version() if request.param == "newest" else request.param
        cli = install_claude_code(version)
    except RuntimeError as e:
        pytest.skip(f"Claude Code is not available: {e}")
    print(f"Claude Code {version} ({request.param})")
    return cli


@pytest.fixture(scope="module")
def cc_server(claude: Path, tmp_path_factory):
    """A 2-layer Qwen-style model whose tokenizer reads English and code in few tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [f.read_text(errors="ignore") for f in sorted(stdlib.glob("*.py"))]
    sdk_types = claude.resolve().parent.parent / "sdk-tools.d.ts"
    if sdk_types.exists():  # the tokenizer reads Claude Code's own words in fewer tokens
        corpus.append(sdk_types.read_text())
    dest = tmp_path_factory.mktemp("models") / "tiny-claude-code"
    build_model(dest, "qwen2", num_layers=2, hidden_size=64, seed=0, vocab_size=VOCAB,
                corpus=corpus, chat_template=QWEN_TEMPLATE,
                extra_config={"max_position_embeddings": CONTEXT,
                              # One token in 20 ends the turn (see the module docstring).
                              "eos_token_id": list(range(VOCAB - VOCAB // 20, VOCAB))})
    with start_server(dest, "--api-key", KEY, home=tmp_path_factory.mktemp("home")) as s:
        yield s


def _turn(claude: Path, url: str, server: Server, home: Path, *args: str) -> dict:
    home.mkdir(exist_ok=True)
    (home / "work").mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY,
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


def _prompt_tokens(server: Server, body: dict) -> int:
    """count_tokens of a /v1/messages body: the prompt the model reads for it."""
    fields = {k: v for k, v in body.items() if k in PromptBody.model_fields}
    r = httpx.post(server.url + "/v1/messages/count_tokens", json=fields,
                   headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def _deferred_tools_left_out(server: Server, posts: list[Exchange]) -> None:
    """Each request's deferred tools are not in its prompt: it counts as many tokens as the same
    request without them."""
    for x in posts:
        body = json.loads(x.body)
        tools = body.get("tools") or []
        if any(t.get("defer_loading") for t in tools):
            without = {**body, "tools": [t for t in tools if not t.get("defer_loading")]}
            assert _prompt_tokens(server, body) == _prompt_tokens(server, without)


@pytest.mark.timeout(2 * TURN_TIMEOUT + 300)
def test_two_turns_of_a_session(claude: Path, cc_server: Server, tmp_path: Path) -> None:
    home = tmp_path / "home"
    with recording_proxy(cc_server.url) as (url, sent):
        first = _turn(claude, url, cc_server, home, "-p", "Say hi.")
        second = _turn(claude, url, cc_server, home, "-p", "And again.",
                       "--resume", first["session_id"])
    # Nothing refused on the way: a refused field makes Claude Code retry with a larger prompt
    # or fail the turn.
    assert not [(x.method, x.path, x.status, x.body[:2000]) for x in sent if x.status >= 400]
    # A result's usage sums its round trips (`num_turns`: two when the random model's reply
    # calls a tool), so each prompt is judged per trip.
    usage = first["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    # Claude Code's whole system prompt and tools arrived, in every request (2.1.332: 12.7k
    # tokens, its deferred tools left out; 2.1.197: 20.7k)
    assert prompt / first["num_turns"] > 10000, usage
    assert usage["output_tokens"] >= 1

    assert second["session_id"] == first["session_id"]
    u = second["usage"]
    again = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    # Each of its requests found all but its last, partial block of the session in the cache.
    assert u["cache_read_input_tokens"] >= (again // CACHE_BLOCK - second["num_turns"]) \
        * CACHE_BLOCK, u
    # One request per round trip Claude Code counts (`num_turns`) and no side requests: a turn
    # takes more than one when the random model's reply happens to call a tool.
    posts = [x for x in sent if x.method == "POST"]
    assert [x.path for x in posts] == ["/v1/messages?beta=true"] * (
        first["num_turns"] + second["num_turns"]), [x.path for x in sent]
    _deferred_tools_left_out(cc_server, posts)
    assert not re.search(r'HTTP/1.1" 4\d\d', cc_server.log_tail(400))


if __name__ == "__main__":
    try:
        print(install_claude_code(newest_version()), install_claude_code(OLDEST))
    except RuntimeError as e:
        raise SystemExit(f"Claude Code is not available: {e}") from None
