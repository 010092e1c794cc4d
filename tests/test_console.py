"""The web console at /console: served without a key under a strict Content-Security-Policy,
and used in a real browser (Playwright driving Debian's chromium headless) against a live
server: an admin key sees the node and the model, unloads the model by its button and gets a
streamed chat answer; a user key gets the reduced view, not a broken page.

OMLX_CONSOLE_SCREENSHOTS=DIR keeps a screenshot of each view there (docs/ holds the README's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.in_process_gateway import app_for, ask

CHROMIUM = Path("/usr/bin/chromium")
ADMIN, USER, OPS = "console-admin-key-1", "console-user-key-1", "console-ops-key-1"
KEYS = f'[[key]]\nname = "reader"\nkey = "{USER}"\n'
OPS_KEY = '[[key]]\nname = "ops"\nkey = "{key}"\nrole = "{role}"\n'
MODEL_ID = "tiny-llama"  # tests/conftest.py's tiny_model_path folder name


def test_the_page_is_served_without_a_key_under_a_strict_policy(tiny_model_path: Path) -> None:
    app = app_for(tiny_model_path, frozenset({"k1"}))
    page = ask(app, "GET", "/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self';" in policy and "connect-src 'self';" in policy
    assert "unsafe-inline" not in policy and "default-src 'none'" in policy
    # No inline script, nothing from another origin: every asset is a path of this server.
    assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "/console/assets/console.js" in assets
    for url in (a for a in assets if not a.startswith("data:")):
        assert url.startswith("/console/assets/"), url
        r = ask(app, "GET", url)
        assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff", url
    # The scripts the module imports are there too, as JavaScript.
    for name in re.findall(r'from "\./(\w+\.js)"', ask(app, "GET", "/console/assets/console.js").text):
        r = ask(app, "GET", f"/console/assets/{name}")
        assert r.status_code == 200 and "javascript" in r.headers["content-type"], name
    # The data is not: the API behind the page still wants the key.
    assert ask(app, "GET", "/cluster/usage").status_code == 401


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: apt-get install chromium (Debian's, driven headless)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="pip install playwright (no `playwright install`: "
                                          "the test drives Debian's chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("console-keys") / "keys.toml"
    path.write_text(KEYS + OPS_KEY.format(key=OPS, role="admin"))
    return path


@pytest.fixture(scope="module")
def console_server(tiny_model_path: Path, keys_file: Path, tmp_path_factory):
    with start_server(tiny_model_path, "--api-key", ADMIN, "--keys-file", str(keys_file),
                      home=tmp_path_factory.mktemp("console-home"), keepalive=None) as server:
        yield server


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    return Path(os.environ.get("OMLX_CONSOLE_SCREENSHOTS") or tmp_path)


@pytest.fixture
def page(browser, console_server):
    """A fresh tab (its own sessionStorage) at 1280x800, dark, that fails the test on any
    script error or Content-Security-Policy violation."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    tab = context.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda e: problems.append(f"script error: {e}"))
    tab.on("console", lambda m: problems.append(m.text)
           if "Content Security Policy" in m.text else None)
    tab.goto(console_server.url + "/console")
    yield tab
    context.close()
    assert not problems, problems


def log_in(page, key: str) -> None:
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Open the console").click()


def chat(url: str, key: str, content: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0,
                         "messages": [{"role": "user", "content": content}]}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_user_key_gets_the_reduced_view(page, console_server, shots: Path) -> None:
    from playwright.sync_api import expect

    log_in(page, "not-a-key")
    expect(page.get_by_role("alert")).to_contain_text("This key was refused")
    page.screenshot(path=shots / "console-login.png")

    chat(console_server.url, USER, "hello", 4)  # a row of its own usage to see
    log_in(page, USER)
    expect(page.locator("#who")).to_have_text("user")
    page.reload()  # the key is kept for the tab: no second login
    expect(page.locator("#who")).to_have_text("user")
    model = page.locator(f'[data-model="{MODEL_ID}"]')
    expect(model).to_contain_text("context 2,048 tokens")
    expect(model.locator(".state")).to_have_text("loaded")
    # No cluster part (its calls answer 403 to this key), no buttons, nothing broken.
    expect(page.locator("#nodes-part")).to_be_hidden()
    expect(model.get_by_role("button")).to_have_count(0)
    expect(page.locator("#notice")).to_be_hidden()
    expect(page.locator(".chart")).to_have_count(4)
    page.screenshot(path=shots / "console-user.png")
    page.get_by_role("button", name="Usage").click()
    # Its own usage only: the admin's key is not in the table.
    expect(page.locator("#usage tbody tr")).to_have_count(1)
    expect(page.locator('#usage tr[data-key="reader"]')).to_contain_text(MODEL_ID)


@pytest.mark.slow
def test_an_admin_sees_the_cluster_chats_and_unloads(page, console_server, shots: Path) -> None:
    from playwright.sync_api import expect

    log_in(page, ADMIN)
    expect(page.locator("#who")).to_have_text("admin")
    node = page.locator('[data-node="local0"]')
    expect(node).to_contain_text("healthy")
    expect(node).to_contain_text(f"{MODEL_ID} layers 0–3")
    model = page.locator(f'[data-model="{MODEL_ID}"]')
    expect(model.locator(".state")).to_have_text("loaded")
    expect(page.locator("#summary")).to_contain_text("Data plane none")

    # A chat streamed by the page: the same answer as the API's, whole, at temperature 0.
    page.get_by_role("button", name="Chat").click()
    page.locator("#chat-temp").fill("0")
    page.locator("#chat-max").fill("24")
    page.get_by_label("message").fill("What is the capital of France?")
    page.get_by_role("button", name="Send").click()
    stats = page.locator(".message.assistant .stats")
    expect(stats).to_contain_text("chunks", timeout=60_000)
    chunks = int(re.search(r"(\d+) chunks", stats.inner_text()).group(1))
    assert chunks > 1, stats.inner_text()  # streamed, not one piece
    expected = chat(console_server.url, ADMIN, "What is the capital of France?", 24)
    assert page.locator(".message.assistant .text").text_content() == expected
    page.screenshot(path=shots / "console-chat.png")

    page.get_by_role("button", name="Usage").click()
    expect(page.locator('#usage tr[data-key="reader"]')).to_be_visible()
    expect(page.locator('#usage tr[data-key="api-key-1"]')).to_be_visible()
    page.screenshot(path=shots / "console-usage.png")

    page.get_by_role("button", name="Cluster").click()
    # The charts have points from the polls around the chat.
    expect(page.locator(".chart path.line0").first).to_have_attribute("d", re.compile("L"))
    page.screenshot(path=shots / "console-cluster.png")
    model.get_by_role("button", name="Unload").click()
    expect(model.locator(".state")).to_have_text("unloaded", timeout=30_000)
    expect(model.get_by_role("button", name="Load")).to_be_enabled()
    assert httpx.get(console_server.url + "/v1/models", timeout=10,
                     headers={"authorization": f"Bearer {ADMIN}"}).json()["data"][0][
        "state"] == "unloaded"


@pytest.mark.slow
def test_an_admin_key_made_a_user_key_gets_the_user_view(page, keys_file: Path) -> None:
    """The keys file is read again without a restart: the open page follows the new role."""
    from playwright.sync_api import expect

    log_in(page, OPS)
    expect(page.locator("#who")).to_have_text("admin")
    expect(page.locator('[data-node="local0"]')).to_be_visible()
    keys_file.write_text(KEYS + OPS_KEY.format(key=OPS, role="user"))
    expect(page.locator("#who")).to_have_text("user", timeout=15_000)
    expect(page.locator("#nodes-part")).to_be_hidden()
    expect(page.locator(f'[data-model="{MODEL_ID}"]')).to_contain_text("context 2,048 tokens")
    expect(page.locator("#notice")).to_be_hidden()
