"""API keys: required on a network-facing gateway, checked on every API call."""

from __future__ import annotations

import os
import subprocess

import httpx
import openai
import pytest
from openai import OpenAI

from omlx_shared.child import omlx_command
from tests.conftest import free_port, start_server


@pytest.mark.slow
def test_keys_are_checked(tiny_model_path, tmp_path):
    with start_server(tiny_model_path, "--api-key", "k-one", "--api-key", "k-two",
                      home=tmp_path / "h", keepalive=None) as server:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # open
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200  # open
        r = httpx.get(server.url + "/v1/models", timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/cluster/status", timeout=5).status_code == 401
        bad = OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        for key in ("k-one", "k-two"):
            client = OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            r = client.completions.create(model=server.model_id, prompt="Hi", max_tokens=3)
            assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("command", ["serve", "coordinator"])
def test_network_facing_gateway_needs_a_key(tiny_model_path, command):
    r = subprocess.run(omlx_command(command, "--model", str(tiny_model_path), "--host",
                                    "0.0.0.0", "--port", str(free_port())),
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "OMLX_API_KEY": ""})
    assert r.returncode == 2
    assert "without an API key" in r.stderr and "--api-key" in r.stderr


@pytest.mark.slow
def test_health_without_a_key_says_only_ready(tiny_model_path, tmp_path):
    """With keys configured, an unauthenticated /health tells a load balancer ready or not,
    never the nodes' addresses, pids, memory or chip."""
    with start_server(tiny_model_path, "--api-key", "k1", home=tmp_path / "h",
                      keepalive=None) as server:
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        full = httpx.get(server.url + "/health", headers={"authorization": "Bearer k1"},
                         timeout=5).json()
        assert full["status"] == "ok" and full["nodes"][0]["address"]


@pytest.mark.slow
def test_rejected_requests_are_counted_by_outcome(tiny_model_path, tmp_path):
    with start_server(tiny_model_path, "--api-key", "k1", home=tmp_path / "h",
                      keepalive=None) as server:
        url = server.url + "/v1/chat/completions"
        auth = {"authorization": "Bearer k1"}
        msgs = [{"role": "user", "content": "hi"}]
        assert httpx.post(url, json={"model": server.model_id, "messages": msgs},
                          timeout=5).status_code == 401
        assert httpx.post(url, json={"model": "nope", "messages": msgs}, headers=auth,
                          timeout=5).status_code == 404
        assert httpx.post(url, json={"model": server.model_id, "messages": msgs,
                                     "max_tokens": "x"}, headers=auth, timeout=5).status_code == 400
        assert httpx.post(url, json={"model": server.model_id, "messages": msgs,
                                     "max_tokens": 2}, headers=auth, timeout=60).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=5).text
        counts = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("omlx_requests_total{")}
        def chat(outcome: str) -> list[float]:
            return [v for k, v in counts.items() if 'endpoint="chat"' in k
                    and f'outcome="{outcome}"' in k]
        # The model no one serves is counted apart, not as a reject of the one served.
        assert chat("rejected") == [2.0] and chat("unknown_model") == [1.0], counts
        assert chat("ok") == [1.0], counts


@pytest.mark.slow
def test_openapi_documents_what_the_server_answers(tiny_model_path, tmp_path):
    with start_server(tiny_model_path, "--api-key", "k1", home=tmp_path / "h",
                      keepalive=None) as server:
        schema = httpx.get(server.url + "/openapi.json", timeout=5,
                           headers={"authorization": "Bearer k1"}).json()
        chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert "422" not in chat and {"400", "401", "404"} <= set(chat)
        metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        assert list(metrics) == ["text/plain"]
        assert "HTTPValidationError" not in str(schema)
