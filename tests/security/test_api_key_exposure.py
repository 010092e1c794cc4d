"""API keys kept out of logs and `ps` (issue 49, part 5): a key sent in the query string never
reaches the access log, and keys come from a 0600 file or the environment as well as --api-key."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from omlx_cluster.api_keys import ApiKeyError, add_api_key_flags, api_keys
from omlx_coordinator.frontdoor.access_log import RedactedQuery, redact_query
from omlx_shared.child import omlx_command
from tests.conftest import free_port, start_server


@pytest.mark.parametrize("target, logged", [
    ("/v1/models?api_key=s3", "/v1/models?api_key=REDACTED"),
    ("/v1/messages?beta=true&x-api-key=s3&token=t&Access_Token=a",
     "/v1/messages?beta=true&x-api-key=REDACTED&token=REDACTED&Access_Token=REDACTED"),
    ("/v1/models?a=1;client_secret=s3&api%5Fkey=s3&password=", "/v1/models?a=1;"
     "client_secret=REDACTED&api%5Fkey=REDACTED&password=REDACTED"),
    ("/v1/models?limit=5", "/v1/models?limit=5"),
    ("/health", "/health"),
])
def test_secret_looking_query_values_are_redacted(target, logged):
    assert redact_query(target) == logged


def test_the_access_log_filter_rewrites_the_path_argument():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/models?api_key=s3", "1.1", 401), None)
    assert RedactedQuery().filter(record)
    assert "s3" not in record.getMessage() and "api_key=REDACTED" in record.getMessage()


def test_an_outsiders_long_path_is_cut_in_the_access_log():
    """A 60 KB path (an outsider's, keyless) makes one short line, control characters escaped."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/" + "a\n" * 30_000, "1.1", 404), None)
    assert RedactedQuery().filter(record)
    line = record.getMessage()
    assert len(line) < 400 and "\n" not in line and "(60001 characters)" in line, line


def given(*argv: str) -> list[str]:
    p = argparse.ArgumentParser()
    add_api_key_flags(p, "a key")
    return api_keys(p.parse_args(argv))


def test_keys_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OMLX_CLUSTER_API_KEY", raising=False)
    monkeypatch.delenv("OMLX_API_KEY", raising=False)
    f = tmp_path / "keys"
    f.write_text("k-one\n\n  k-two  \n")
    f.chmod(0o600)
    assert given("--api-key-file", str(f)) == ["k-one", "k-two"]
    assert given("--api-key", "k0", "--api-key-file", str(f)) == ["k0", "k-one", "k-two"]
    assert given() == []
    monkeypatch.setenv("OMLX_API_KEY", "old")  # the variable's older name still works
    assert given() == ["old"]
    monkeypatch.setenv("OMLX_CLUSTER_API_KEY", "e1, e2")
    assert given() == ["e1", "e2"]
    assert given("--api-key", "k0") == ["k0"]  # a flag, not the environment
    f.chmod(0o644)
    with pytest.raises(ApiKeyError, match=f"readable by other users.*chmod 600 {f}"):
        given("--api-key-file", str(f))
    with pytest.raises(ApiKeyError, match="empty"):
        given("--api-key", " ")


@pytest.mark.slow
def test_a_key_file_open_to_others_is_refused_at_start(tiny_model_path, tmp_path):
    f = tmp_path / "keys"
    f.write_text("k1\n")
    f.chmod(0o644)
    r = subprocess.run(omlx_command("serve", "--model", str(tiny_model_path), "--port",
                                    str(free_port()), "--api-key-file", str(f)),
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OMLX_CLUSTER_HOME": str(tmp_path / "h")})
    assert r.returncode == 2, r.stderr
    assert f"chmod 600 {f}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_key_in_the_query_string_never_reaches_the_log(tiny_model_path, tmp_path):
    """The gateway keyed from a 0600 file: the key works as a header, a key sent as
    ?api_key= is refused and the access log names the parameter but not the key, and a client
    command finds the key in $OMLX_CLUSTER_API_KEY."""
    key = "SECRETVALUE-5f1c9e"
    f = tmp_path / "keys"
    f.write_text(f"{key}\n")
    f.chmod(0o600)
    with start_server(tiny_model_path, "--api-key-file", str(f), home=tmp_path / "h",
                      keepalive=None) as server:
        r = httpx.get(server.url + f"/v1/models?api_key={key}&beta=true", timeout=10)
        assert r.status_code == 401
        r = httpx.get(server.url + f"/v1/models?token={key}x", timeout=10)
        assert r.status_code == 401
        r = httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {key}"},
                      timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == server.model_id
        status = subprocess.run(omlx_command("status", "--url", server.url, "--json"),
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "OMLX_CLUSTER_API_KEY": key})
        assert status.returncode == 0 and '"nodes"' in status.stdout, status.stderr
        log = Path(server.log_path).read_text(errors="replace")
    assert "/v1/models?api_key=REDACTED&beta=true" in log  # the access log is on
    assert "token=REDACTED" in log
    assert key not in log
