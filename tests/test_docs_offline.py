"""/docs and /redoc work on a LAN without the internet (their assets served by the gateway)
and need the API key when the gateway has one."""

from __future__ import annotations

import re
from pathlib import Path

from tests.in_process_gateway import app_for, ask


def test_docs_load_their_assets_from_the_gateway(tiny_model_path: Path) -> None:
    app = app_for(tiny_model_path)
    for page in ("/docs", "/redoc"):
        html = ask(app, "GET", page).text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
        assert assets, html
        # Nothing from a CDN: every asset is a path of this server, and it answers.
        for url in assets:
            assert url.startswith("/"), url
            assert ask(app, "GET", url).status_code == 200, url
    assert "/v1/chat/completions" in ask(app, "GET", "/openapi.json").json()["paths"]


def test_docs_need_the_key_when_there_is_one(tiny_model_path: Path) -> None:
    app = app_for(tiny_model_path, frozenset({"k1"}))
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert ask(app, "GET", page).status_code == 401, page
        assert ask(app, "GET", page, headers={"authorization": "Bearer k1"}).status_code == 200
