"""Named keys on a live server, through the real SDKs: quotas answer 429 in each API's shape,
a model a key may not use 403, the keys file is read again without a restart, usage is kept
across a restart and shown per key in /metrics, and no key reaches the log."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.slow

ALICE, BOB, DAVE, ROOT, CAROL = ("alice-key-1234", "bob-key-5678", "dave-key-9012",
                                 "root-key-3456", "carol-key-7890")
KEYS = f"""
[[key]]
name = "alice"
key = "{ALICE}"
requests_per_minute = 2

[[key]]
name = "bob"
key = "{BOB}"
models = ["not-this-one"]

[[key]]
name = "dave"
key = "{DAVE}"
tokens_per_day = 1

[[key]]
name = "root"
key = "{ROOT}"
role = "admin"
"""


def chat(server, key: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    return client.chat.completions.create(model=server.model_id, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}])


def message(server, key: str):
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    return client.messages.create(model=server.model_id, max_tokens=4,
                                  messages=[{"role": "user", "content": "hello"}])


def usage_of(server, key: str = ROOT) -> dict:
    r = httpx.get(server.url + "/cluster/usage", headers={"authorization": f"Bearer {key}"},
                  timeout=10)
    assert r.status_code == 200, r.text
    return {k["key"]: k["models"][0] for k in r.json()["keys"]}


def test_keys_quotas_and_usage_on_a_live_server(tiny_model_path, tmp_path):
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(KEYS)
    home = tmp_path / "h"
    flags = ("--keys-file", str(keys_file))
    with start_server(tiny_model_path, *flags, home=home, keepalive=None) as server:
        assert chat(server, ALICE).usage.completion_tokens >= 1
        assert message(server, ALICE).usage.output_tokens >= 1
        with pytest.raises(openai.RateLimitError) as e:
            chat(server, ALICE)
        assert e.value.code == "rate_limit_exceeded" and "2 requests a minute" in str(e.value)
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
        with pytest.raises(anthropic.RateLimitError) as e:
            message(server, ALICE)
        assert e.value.status_code == 429 and e.value.body["error"]["type"] == "rate_limit_error"

        # A model the key may not use.
        with pytest.raises(openai.PermissionDeniedError, match="may not use the model"):
            chat(server, BOB)
        with pytest.raises(anthropic.PermissionDeniedError):
            message(server, BOB)
        # A user key cannot unload; an admin's can read everything.
        r = httpx.post(f"{server.url}/cluster/models/{server.model_id}/unload",
                       headers={"authorization": f"Bearer {ALICE}"}, timeout=10)
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"]

        # A day's token quota: the request that crosses it is served, the next is refused.
        chat(server, DAVE)
        with pytest.raises(openai.RateLimitError, match="tokens of today"):
            chat(server, DAVE)

        # A key added to the file works without a restart.
        keys_file.write_text(KEYS + f'\n[[key]]\nname = "carol"\nkey = "{CAROL}"\n')
        deadline = time.monotonic() + 10
        while True:
            try:
                chat(server, CAROL)
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, "the new key was never taken"
                time.sleep(0.3)

        used = usage_of(server)
        assert used["alice"]["requests"] == 2 and used["alice"]["prompt_tokens"] > 0
        assert used["alice"]["completion_tokens"] >= 2
        assert "bob" not in used  # refused requests are not usage
        assert usage_of(server, ALICE).keys() == {"alice"}
        metrics = server.metrics()
        assert metrics['omlx_key_requests_total{key="alice"}'] == 2  # (the model label aside)
        log = server.log_path.read_text()
    for key in (ALICE, BOB, DAVE, ROOT, CAROL):
        assert key not in log

    with start_server(tiny_model_path, *flags, home=home, keepalive=None) as server:
        assert usage_of(server) == used
