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
