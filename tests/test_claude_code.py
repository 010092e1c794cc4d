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
exceeded the output token maximum"): the tiny model of tests/agent_clients.py ends its replies
after about 20 tokens.

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
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from omlx_coordinator.api.anthropic_schema import PromptBody
from tests.agent_clients import (
    TURN_TIMEOUT,
    build_agent_model,
    install_cli,
    newest_version,
    offline_env,
)
from tests.conftest import Server, start_server
from tests.recording_proxy import Exchange, recording_proxy

pytestmark = pytest.mark.slow

OLDEST = "2.1.197"  # the oldest release we promise to serve
PACKAGE = "@anthropic-ai/claude-code"
KEY = "sk-ant-claude-code-test"
CACHE_BLOCK = 256  # the server's default prefix-cache block


def install_claude_code(version: str) -> Path:
    """The `claude` CLI of `version`, from the test cache."""
    return install_cli(PACKAGE, "claude", f"claude-code-{version}", version)[0]


@pytest.fixture(scope="module", params=["newest", OLDEST])
def claude(request) -> Path:
    try:
        version = newest_version(PACKAGE) if request.param == "newest" else request.param
        cli = install_claude_code(version)
    except RuntimeError as e:
        pytest.skip(f"Claude Code is not available: {e}")
    print(f"Claude Code {version} ({request.param})")
    return cli


@pytest.fixture(scope="module")
def cc_server(claude: Path, tmp_path_factory):
    sdk_types = claude.resolve().parent.parent / "sdk-tools.d.ts"
    # The tokenizer reads Claude Code's own words in fewer tokens.
    extra = (sdk_types.read_text(),) if sdk_types.exists() else ()
    dest = build_agent_model(tmp_path_factory.mktemp("models") / "tiny-claude-code", extra)
    with start_server(dest, "--api-key", KEY, home=tmp_path_factory.mktemp("home")) as s:
        yield s


def _turn(claude: Path, url: str, server: Server, home: Path, *args: str) -> dict:
    home.mkdir(exist_ok=True)
    (home / "work").mkdir(exist_ok=True)
    env = offline_env(home, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY=KEY,
                      ANTHROPIC_MODEL=server.model_id,
                      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1")
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
        print(install_claude_code(newest_version(PACKAGE)), install_claude_code(OLDEST))
    except RuntimeError as e:
        raise SystemExit(f"Claude Code is not available: {e}") from None
