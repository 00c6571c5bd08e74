"""The chat page at / in a real browser: Debian's headless Chromium, driven over the DevTools protocol
(tests/py/cdp.py). The page is loaded from `kestrel serve --api-key`, the key is typed into its
settings, a message is typed and sent with Enter, and the answer must stream into the DOM (seen
growing while the request runs) and end equal to the same request's answer from the API. A
screenshot is kept at build/test-artifacts/chat_page.png. The fake engine (random tokens, paced)
makes the stream long enough to watch; the page only knows the OpenAI API."""
import os
import pathlib
import time

import httpx
import pytest

from cdp import Browser, chromium_path
from serve_util import Server

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "build" / "test-artifacts"

pytestmark = pytest.mark.skipif(chromium_path() is None and os.environ.get("KESTREL_REQUIRE_CHROMIUM") != "1",
                                reason="chromium is not installed (KESTREL_INSTALL_CHROMIUM=1 scripts/install-deps.sh installs it)")


@pytest.fixture(scope="module")
def server(kestrel_bin, nano_dir):
    s = Server(kestrel_bin, nano_dir, "--served-model-name", "nano", "--api-key", "sekrit", "--fake-engine",
               "--fake-delay-ms", "40", "--max-model-len", "4096")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


def test_page_is_served_without_a_key(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script>" in r.text and "http://" not in r.text.split("<script>")[1]  # nothing fetched from elsewhere


def test_chat_in_the_browser_streams_the_answer(server, browser):
    browser.navigate(server.url + "/")
    # Without the key the page asks for it (its /v1/models call got a 401).
    browser.wait_for("document.getElementById('model').textContent.includes('API key')")
    browser.type_text("#api-key", "sekrit")
    browser.eval("document.getElementById('api-key').dispatchEvent(new Event('change'))")
    browser.wait_for("document.getElementById('model').textContent.startsWith('nano')")
    # Settings: greedy, 40 tokens, high effort (kept in localStorage like a user's choice).
    for field, value in (("temperature", "0"), ("max-tokens", "40"), ("effort", "high")):
        browser.eval(f"(() => {{ const e = document.getElementById('{field}'); e.value = '{value}';"
                     f" e.dispatchEvent(new Event('change')); }})()")
    browser.type_text("#input", "Hello from the browser")
    browser.press_enter()
    browser.wait_for("document.querySelector('.msg.user') !== null")
    text_js = ("(() => { const m = document.querySelector('.msg.assistant'); if (!m) return null;"
               " return {state: m.dataset.state, reasoning: m.querySelector('.reasoning-text').textContent,"
               " content: m.querySelector('.content').textContent, meta: m.querySelector('.meta').textContent,"
               " folded: !m.querySelector('details.reasoning').open}; })()")
    seen = set()
    deadline = time.time() + 60
    while time.time() < deadline:
        v = browser.eval(text_js)
        if v:
            seen.add(len(v["reasoning"]) + len(v["content"]))
            if v["state"] == "done":
                break
        time.sleep(0.03)
    assert v and v["state"] == "done", v
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.screenshot(str(ARTIFACTS / "chat_page.png"))
    assert (ARTIFACTS / "chat_page.png").stat().st_size > 5000
    # It streamed: the DOM showed the answer at several lengths before the end.
    assert len(seen) >= 4, seen
    assert "tokens" in v["meta"], v["meta"]
    if v["content"]:
        assert v["folded"]  # the reasoning folds away once the answer begins
    # The same request through the API gives the text the page shows.
    api = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": "Bearer sekrit"}, timeout=60,
                     json={"model": "nano", "messages": [{"role": "user", "content": "Hello from the browser"}],
                           "temperature": 0, "max_tokens": 40, "reasoning_effort": "high"}).json()
    msg = api["choices"][0]["message"]
    assert v["reasoning"] == (msg["reasoning_content"] or "")
    assert v["content"] == (msg["content"] or "")
    # A second turn carries the history.
    browser.type_text("#input", "And again")
    browser.press_enter()
    browser.wait_for("document.querySelectorAll('.msg.assistant').length === 2 && "
                     "document.querySelectorAll('.msg.assistant')[1].dataset.state === 'done'", timeout=60)
    assert browser.eval("document.querySelectorAll('.msg.user').length") == 2
