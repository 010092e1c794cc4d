"""The gateway's front door: HTTPS with a kept self-signed certificate that clients pin by its
fingerprint, and sockets that are idle or send headers a byte at a time (slowloris) let go
without locking real clients out."""

from __future__ import annotations

import hashlib
import re
import socket
import ssl
import time

import httpx
import openai
import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.slow

KEY = "front-door-key"


def printed_fingerprint(log: str) -> str:
    found = re.findall(r"SHA-256 fingerprint ([0-9A-F:]{95})", log)
    assert found, log
    return found[-1]


def served_fingerprint(url: str) -> str:
    host, port = url.removeprefix("https://").split(":")
    der = ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate((host, int(port))))
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def test_https_self_signed_pinned_by_fingerprint(tiny_model_path, tmp_path):
    home = tmp_path / "h"
    flags = ("--tls", "self-signed", "--api-key", KEY)
    with start_server(tiny_model_path, *flags, home=home, scheme="https") as server:
        pinned = printed_fingerprint(server.log_path.read_text())
        # A client checks what the server presents against the fingerprint it was given, and
        # then trusts that certificate.
        assert served_fingerprint(server.url) == pinned
        cert = home / "gateway-tls" / "cert.pem"
        assert oct((home / "gateway-tls" / "key.pem").stat().st_mode & 0o777) == "0o600"
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(
                                   cafile=str(cert))))
        r = client.completions.create(model=server.model_id, prompt="Hi", max_tokens=3)
        assert r.usage.completion_tokens >= 1
        # Without trusting it, the SDK refuses the connection.
        untrusting = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
    # The pair is kept: a restart presents the same certificate.
    with start_server(tiny_model_path, *flags, home=home, scheme="https") as server:
        assert served_fingerprint(server.url) == pinned


def test_bad_tls_flags_are_refused_at_start(tiny_model_path, tmp_path):
    import subprocess
    import sys

    cases = [(["--tls-cert", str(tmp_path / "c.pem")], "--tls-cert and --tls-key go together"),
             (["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")],
              "no such file")]
    for flags, says in cases:
        r = subprocess.run([sys.executable, "-m", "omlx_cluster", "serve", "--model",
                            str(tiny_model_path), "--port", "0", *flags],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_idle_and_slow_sockets_do_not_lock_clients_out(tiny_model_path, tmp_path):
    with start_server(tiny_model_path, "--header-timeout", "2", "--max-connections", "300",
                      home=tmp_path / "h") as server:
        port = int(server.url.rsplit(":", 1)[1])
        socks = []
        for i in range(500):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:  # a request begun, its headers never finished
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: ")
            socks.append(s)
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                   timeout=60)
            r = client.chat.completions.create(
                model=server.model_id, max_tokens=3,
                messages=[{"role": "user", "content": "hello"}])
            assert r.usage.completion_tokens >= 1
            # Every one of them is let go: past the bound at once, the rest at the deadline.
            deadline = time.monotonic() + 30
            for s in socks:
                s.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    assert s.recv(1024) == b""
                except ConnectionResetError:
                    pass
        finally:
            for s in socks:
                s.close()
        assert "closed connections that sent no whole request header" in \
            server.log_path.read_text()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
