"""Named keys with roles and quotas, and the usage ledger, without a live node: the keys file's
rules, reloading it, constant-time comparison, quotas, persistence, and the gateway's 401/403
answers and usage report in-process."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time

import pytest

from omlx_coordinator.frontdoor import keys as keys_module
from omlx_coordinator.frontdoor.keys import KeyRing, KeysFileError, parse_keys
from omlx_coordinator.frontdoor.usage import Usage, parse_since, today
from tests.in_process_gateway import app_for, ask

ALICE, BOB, ROOT = "alice-secret-key", "bob-secret-key", "root-secret-key"
KEYS_FILE = f"""
[[key]]
name = "alice"
key = "{ALICE}"
role = "user"
models = ["m"]
requests_per_minute = 2

[[key]]
name = "bob"
key_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"
role = "user"
models = ["other"]
priority = "batch"

[[key]]
name = "root"
key = "{ROOT}"
role = "admin"
"""


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("entry, says", [
    ('name = "a"', "exactly one of 'key' and 'key_sha256'"),
    ('name = "a"\nkey = "k"\nkey_sha256 = "00"', "exactly one of"),
    ('name = "a"\nkey_sha256 = "abc"', "64 hex digits"),
    ('name = "a b"\nkey = "k"', "without spaces"),
    ('name = "a"\nkey = "k"\nrole = "root"', "'role' must be one of user, admin"),
    ('name = "a"\nkey = "k"\npriority = "urgent"', "'priority' must be one of"),
    ('name = "a"\nkey = "k"\ntokens_per_day = 0', "'tokens_per_day' must be a positive"),
    ('name = "a"\nkey = "k"\nmodels = "m"', "'models' must be a list"),
    ('name = "a"\nkey = "k"\nrpm = 3', "unknown field(s) ['rpm']"),
])
def test_a_bad_key_entry_says_what_to_fix(entry, says):
    with pytest.raises(KeysFileError, match=None) as e:
        parse_keys(f"[[key]]\n{entry}\n")
    assert says in str(e.value)


def test_duplicates_and_bad_toml_are_refused():
    with pytest.raises(KeysFileError, match="same name"):
        parse_keys('[[key]]\nname="a"\nkey="k1"\n[[key]]\nname="a"\nkey="k2"\n')
    with pytest.raises(KeysFileError, match="same key"):
        parse_keys('[[key]]\nname="a"\nkey="k1"\n[[key]]\nname="b"\nkey="k1"\n')
    with pytest.raises(KeysFileError, match="not valid TOML"):
        parse_keys("[[key]\n")


def test_keys_by_value_and_by_hash_and_the_api_key_admins(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    ring = KeyRing(["plain-admin"], path)
    assert ring.identify(ALICE).name == "alice" and not ring.identify(ALICE).admin
    assert ring.identify(BOB).priority == "batch"
    assert ring.identify("plain-admin").name == "api-key-1" and ring.identify("plain-admin").admin
    assert ring.identify("nobody") is None and ring.identify("") is None
    path.write_text('[[key]]\nname = "api-key-1"\nkey = "x"\n')
    with pytest.raises(KeysFileError, match="--api-key keys' own"):
        KeyRing(["plain-admin"], path)


def test_every_key_is_compared_in_constant_time(tmp_path, monkeypatch):
    """Whichever key matches (the first, the last, none), every key's digest is compared with
    hmac.compare_digest: nothing returns early."""
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    ring = KeyRing([], path)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(keys_module.hmac, "compare_digest",
                        lambda a, b: calls.append(1) or real(a, b))
    for presented in (ALICE, ROOT, "wrong"):
        calls.clear()
        ring.identify(presented)
        assert len(calls) == 3


def test_the_file_is_read_again_when_it_changes(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(keys_module, "RELOAD_CHECK_SECONDS", 0.0)
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    ring = KeyRing([], path)
    assert ring.identify("carol-key") is None
    path.write_text(KEYS_FILE + '\n[[key]]\nname = "carol"\nkey = "carol-key"\n')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert ring.identify("carol-key").name == "carol"
    # A broken edit keeps the keys as they were, and says why.
    path.write_text("[[key]\n")
    assert ring.identify("carol-key").name == "carol"
    assert "keeping the keys as they were" in caplog.text and "carol-key" not in caplog.text


def test_quotas(tmp_path):
    ring = KeyRing([], None)
    usage = Usage(tmp_path / "usage.json")
    key = parse_keys('[[key]]\nname="a"\nkey="k"\nrequests_per_minute=2\n'
                     'tokens_per_day=100\n')[0]
    assert ring.open and usage.check(key) is None
    usage.admitted("a", "m")
    usage.admitted("a", "m")
    over = usage.check(key)
    assert over is not None and "2 requests a minute" in over.message
    assert 1 <= over.retry_after <= 60
    usage._recent.clear()
    usage.finished("a", "m", prompt=60, cached=10, completion=40, failed=False)
    over = usage.check(key)
    assert over is not None and "100 tokens of today" in over.message
    assert over.retry_after <= 86400


def test_usage_survives_a_restart_and_sums_days(tmp_path):
    path = tmp_path / "usage.json"
    usage = Usage(path)
    usage.admitted("a", "m")
    usage.finished("a", "m", prompt=10, cached=4, completion=5, failed=False)
    usage.days["2020-01-01"] = {"a": {"m": type(usage.days[today()]["a"]["m"])(requests=7)}}
    usage.save()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    again = Usage(path)
    assert again.totals()["a"]["m"].requests == 8
    since = again.totals(today())["a"]["m"]
    assert (since.requests, since.prompt_tokens, since.cached_tokens,
            since.completion_tokens) == (1, 10, 4, 5)
    assert parse_since("2026-12-01T23:30:00-02:00") == "2026-12-02"
    path.write_text("{not json")
    assert Usage(path).totals() == {} and (tmp_path / "usage.json.bad").exists()


@pytest.fixture
def gateway(tiny_model_path, tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(KEYS_FILE)
    usage = Usage(tmp_path / "usage.json")
    usage.admitted("alice", "m")
    usage.admitted("bob", "other")
    return app_for(tiny_model_path, keys_file=path, usage=usage)


def test_roles_on_the_gateway(gateway):
    assert ask(gateway, "GET", "/cluster/status").status_code == 401
    for method, path in (("GET", "/cluster/status"), ("GET", "/cluster/rebalance"),
                         ("POST", "/cluster/models/m/unload"), ("POST", "/cluster/models/m/pin"),
                         ("GET", "/cluster/prometheus-targets")):
        r = ask(gateway, method, path, headers=bearer(ALICE))
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "admin_required"
        assert "needs an admin key" in r.json()["error"]["message"]
    assert ask(gateway, "GET", "/cluster/status", headers=bearer(ROOT)).status_code == 200
    # /health: the details only for an admin.
    assert set(ask(gateway, "GET", "/health", headers=bearer(ALICE)).json()) == {"status"}
    assert "nodes" in ask(gateway, "GET", "/health", headers=bearer(ROOT)).json()
    # A user key lists only the models it may use.
    assert [m["id"] for m in ask(gateway, "GET", "/v1/models",
                                 headers=bearer(ALICE)).json()["data"]] == ["m"]
    assert ask(gateway, "GET", "/v1/models", headers=bearer(BOB)).json()["data"] == []
    # So do Ollama's model routes.
    assert [m["name"] for m in ask(gateway, "GET", "/api/tags",
                                   headers=bearer(ALICE)).json()["models"]] == ["m"]
    assert ask(gateway, "GET", "/api/tags", headers=bearer(BOB)).json()["models"] == []


def test_a_model_the_key_may_not_use_is_a_403(gateway):
    r = ask(gateway, "POST", "/v1/chat/completions", headers=bearer(BOB),
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert "'bob' may not use the model 'm'; it may use: other" in r.json()["error"]["message"]
    r = ask(gateway, "POST", "/v1/messages", headers={"x-api-key": BOB}, json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


def test_usage_report_by_role(gateway):
    own = ask(gateway, "GET", "/cluster/usage", headers=bearer(ALICE)).json()
    assert [k["key"] for k in own["keys"]] == ["alice"]
    assert own["keys"][0]["models"][0] == {"model": "m", "requests": 1, "prompt_tokens": 0,
                                           "cached_tokens": 0, "completion_tokens": 0,
                                           "errors": 0}
    r = ask(gateway, "GET", "/cluster/usage?key=bob", headers=bearer(ALICE))
    assert r.status_code == 403
    everyone = ask(gateway, "GET", "/cluster/usage", headers=bearer(ROOT)).json()
    assert [k["key"] for k in everyone["keys"]] == ["alice", "bob"]
    one = ask(gateway, "GET", "/cluster/usage?key=bob&since=2026-01-01",
              headers=bearer(ROOT)).json()
    assert [k["key"] for k in one["keys"]] == ["bob"] and one["since"] == "2026-01-01"
    assert ask(gateway, "GET", "/cluster/usage?since=2999-01-01",
               headers=bearer(ROOT)).json()["keys"] == []
    r = ask(gateway, "GET", "/cluster/usage?since=yesterday", headers=bearer(ROOT))
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    # /metrics names keys, never shows them.
    text = ask(gateway, "GET", "/metrics").text
    assert 'omlx_key_requests_total{key="alice",model="m"} 1.0' in text
    assert ALICE not in text and json.dumps(ROOT) not in text
