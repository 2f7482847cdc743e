"""The chat page in a real headless browser: Debian's Chromium driven by Playwright, against a real server.

A Spanish question is typed, the answer streams in (several updates, tokens per second shown), the Stop
button ends it in the page and on the server, and the next question carries the conversation so far.
The `chromium` fixture (conftest.py) installs Debian's chromium when it is missing and marks this test
`browser`; if it cannot be installed, the test fails saying so.

Every wait is for an event: a state of the page's DOM or of the server's /health, each under a generous
ceiling (WAIT) that only a broken page or server reaches, so a slow or busy machine takes longer, never fails.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import make_folder
from serve_helpers import Server, quiet_eos

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
MAX_TOKENS = 100_000
QUESTION = "¿Qué podemos cenar hoy con huevos, patatas y cebolla? Explícamelo paso a paso, por favor."
WAIT = 180  # seconds: the ceiling of every wait (browser launch, each DOM state, each server state)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-page")
    # Answers that cannot end before the test stops them, however fast the server or slow the page: the
    # model all but never picks its end token, and the length budget takes far longer to generate than the
    # test runs (the context holds it after any first answer, so the second answer's budget is as long). The
    # second question's prompt holds the first answer, as long as a slow page took to stop it: no prompt cap.
    folder = quiet_eos(make_folder(root / "base", tied=False, max_position_embeddings=2 * MAX_TOKENS))
    args = ["--model", str(folder), "--max-tokens", str(MAX_TOKENS), "--max-prompt-tokens", str(MAX_TOKENS)]
    s = Server(args, cwd=root, log=root / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=ARGS, headless=True, timeout=WAIT * 1000)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    # Every Playwright wait (wait_for_function, a locator waiting for its element, a click waiting for its
    # button to be enabled) has this ceiling; Playwright's own default is 30 s.
    page.set_default_timeout(WAIT * 1000)
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"error: {e}"))
    yield page
    # Printed at teardown, which pytest shows only for a failed test: where the page and the server stood.
    print("console:", *console, sep="\n  ")
    print("messages:", page.inner_html("#messages", timeout=5000)[-3000:])
    print("server /health:", server.health())
    print("server log:", server.log_text()[-3000:])
    page.close()


def test_chat_page_streams_and_stops(server, page, tmp_path):
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None,
    )
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'base'")
    assert page.is_disabled("#stop") and not page.is_disabled("#send")

    page.fill("#prompt", QUESTION)
    page.keyboard.press("Enter")
    user = page.locator(".msg.user").first
    assert user.inner_text() == QUESTION  # the Spanish text arrives whole
    answer = page.locator(".msg.assistant").first
    page.wait_for_function("Number(document.querySelector('.msg.assistant').dataset.updates) >= 2")
    seen = answer.locator(".text").text_content()
    grown = f"document.querySelector('.msg.assistant .text').textContent.length > {len(seen)}"
    page.wait_for_function(grown)  # still streaming: the text keeps growing
    assert answer.get_attribute("data-state") == "streaming" and not page.is_disabled("#stop")
    page.wait_for_function("document.getElementById('speed').textContent.includes('tokens/s')")
    assert bodies[0]["stream"] is True and bodies[0]["messages"] == [{"role": "user", "content": QUESTION}]

    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant').dataset.state === 'stopped'")
    assert "(detenido)" in answer.inner_text() and page.is_disabled("#stop")
    h = server.wait_for(lambda h: h["busy"] == 0, timeout=WAIT, what="generation stopped on the server")
    assert h["cancelled"] == 1 and 0 < h["tokens_generated"] < MAX_TOKENS
    stopped_text = answer.locator(".text").text_content()
    # Not a wait but a look for something that must not happen: a slower machine only makes it see less.
    time.sleep(0.5)
    assert answer.locator(".text").text_content() == stopped_text  # nothing arrives after Stop

    page.screenshot(path=str(tmp_path / "chat.png"))  # looked at by hand when the page changes

    # The next question carries the conversation: the first question and the part of the answer it got.
    page.fill("#prompt", "¿Y de postre?")
    page.click("#send")
    page.wait_for_function("Number(document.querySelectorAll('.msg.assistant')[1]?.dataset.updates) >= 2")
    roles = [m["role"] for m in bodies[1]["messages"]]
    assert roles == ["user", "assistant", "user"] and bodies[1]["messages"][1]["content"] == stopped_text
    page.click("#stop")
    page.wait_for_function("document.querySelectorAll('.msg.assistant')[1].dataset.state === 'stopped'")
    server.wait_for(lambda h: h["busy"] == 0 and h["cancelled"] == 2, timeout=WAIT, what="second stop")
