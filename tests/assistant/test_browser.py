"""The assistant's web page in headless Chromium (issue 20): a customer signs in through /test-login and
confirms transfers (button and typed "yes"); a second browser context without the token, and a page of
another origin, cannot use that customer's session. The bank's own records say what moved."""

from __future__ import annotations

import http.server
import os
import re
import secrets
import shutil
import threading
from dataclasses import dataclass

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright
from served import UvicornThread

from g4serve_assistant.app import AccessSettings, build_app
from g4serve_assistant.auth import TokenSigner
from g4serve_assistant.db import SQLiteBank, demo_bank
from g4serve_assistant.pipeline import Assistant

CHROMIUM = shutil.which("chromium")
# .ci/run sets this: there a missing browser fails the test instead of skipping it.
REQUIRED = bool(os.environ.get("G4SERVE_REQUIRE_BROWSER"))
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None and not REQUIRED,
        reason="no chromium executable on PATH (Debian: apt-get install chromium)",
    ),
]
TIMEOUT_MS = 10_000  # every wait, the expect() assertions' included: generous on a busy 2-core machine
expect.set_options(timeout=TIMEOUT_MS)
# What Chromium logs for a fetch the server answers with an error: expected only for the deliberate attempts.
REFUSED_FETCH = re.compile(r"Failed to load resource: the server responded with a status of (401|403)\b")


class TypedOnly:
    """The recogniser of a test that only types. The WebSocket builds one per customer when it opens, and a
    pocketsphinx LM costs ~0.7 s; any audio reaching it here would be the test's own bug."""

    def update_vocabulary(self, vocab) -> None:
        pass

    def stream(self):
        raise AssertionError("the browser test only types: nothing should reach the recogniser")

    def transcribe(self, audio):
        raise AssertionError("the browser test only types: nothing should reach the recogniser")


@dataclass
class Served:
    url: str
    bank: SQLiteBank
    assistant: Assistant

    def transfers(self, customer_id: str = "cust-001") -> list[tuple[int, str, str]]:
        """(amount_minor, currency, status) of every transfer the bank holds for the customer."""
        rows = self.bank.customer(customer_id).transfers()
        return [(t["amount_minor"], t["currency"], t["status"]) for t in rows]

    def rejections(self, stage: str, origin: str | None = None) -> list[dict]:
        return [
            e
            for e in self.assistant.audit.entries()
            if e["stage"] == stage
            and e["outcome"] == "rejected"
            and (origin is None or e["client"].get("origin") == origin)
        ]


@pytest.fixture
def served():
    bank = demo_bank()
    assistant = Assistant(bank, engine=None, recognizer=TypedOnly())
    app = build_app(assistant, AccessSettings.ephemeral(test_login=True), warmup=False)
    with UvicornThread(app) as server:
        yield Served(server.url, bank, assistant)
    bank.close()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("G4SERVE_REQUIRE_BROWSER is set but no chromium executable is on PATH")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


class Console:
    """Every console error and uncaught exception of a page: a broken page must fail the test."""

    def __init__(self, page: Page):
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _console(self, message) -> None:
        if message.type == "error":
            self.errors.append(f"console error: {message.text} ({message.location.get('url')})")

    def unexpected(self, allowed: re.Pattern | None = None) -> list[str]:
        return [e for e in self.errors if allowed is None or not allowed.search(e)]


def new_page(browser: Browser) -> tuple[BrowserContext, Page, Console]:
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    return context, page, Console(page)


def sign_in(page: Page, console: Console, served: Served, customer_id: str = "cust-001") -> None:
    page.goto(served.url + "/test-login")
    assert console.unexpected() == []  # a CSP that blocks the page's script shows here, not as a timeout
    page.fill("#customer", customer_id)
    page.click("#signin")
    page.wait_for_url(served.url + "/")
    expect(page.locator("#status")).to_have_text(f"signed in as {customer_id}")
    expect(page.locator("#signedout")).to_be_hidden()


def say(page: Page, text: str) -> None:
    """Types a turn and waits for its result at the top of the log."""
    turns = page.locator("#log .turn")
    before = turns.count()
    page.fill("#text", text)
    page.press("#text", "Enter")
    expect(turns).to_have_count(before + 1)


def last_pills(page: Page) -> list[str]:
    return page.locator("#log .turn").first.locator(".pill").all_inner_texts()


def ask_transfer(page: Page, text: str, summary: str) -> None:
    say(page, text)
    expect(page.locator("#status")).to_have_text("connected")
    assert "needs confirmation" in last_pills(page)
    expect(page.locator("#confirmbar")).to_be_visible()
    expect(page.locator("#pendingtext")).to_contain_text(summary)


def click_and_wait(page: Page, button: str) -> None:
    turns = page.locator("#log .turn")
    before = turns.count()
    page.click(button)
    expect(turns).to_have_count(before + 1)


def test_sign_in_and_confirm_transfers(served: Served, browser: Browser):
    context, page, console = new_page(browser)
    try:
        sign_in(page, console, served)

        ask_transfer(page, "send fifty dollars to John Smith", "$50.00 to John Smith")
        assert served.transfers() == [(5000, "USD", "pending")]  # asked, nothing moved yet
        click_and_wait(page, "#confirm")
        assert "executed" in last_pills(page)
        expect(page.locator("#confirmbar")).to_be_hidden()
        assert served.transfers() == [(5000, "USD", "executed")]

        # The typed path: "yes" in the text box confirms the action the bar showed.
        ask_transfer(page, "send twenty dollars to John Smith", "$20.00 to John Smith")
        say(page, "yes")
        assert "executed" in last_pills(page)
        expect(page.locator("#confirmbar")).to_be_hidden()
        assert served.transfers() == [(5000, "USD", "executed"), (2000, "USD", "executed")]

        ask_transfer(page, "send thirty dollars to John Smith", "$30.00 to John Smith")
        click_and_wait(page, "#cancel")
        assert "executed" not in last_pills(page)
        expect(page.locator("#confirmbar")).to_be_hidden()
        assert served.transfers() == [
            (5000, "USD", "executed"),
            (2000, "USD", "executed"),
            (3000, "USD", "cancelled"),
        ]
        assert served.transfers("cust-002") == []
        assert console.unexpected() == []
    finally:
        context.close()


# From a page: POST a turn with the given session id and (optional) bearer token; the status and body.
_FETCH_TURN = """async ([url, sessionId, actionId, token]) => {
  const headers = {"content-type": "application/json"};
  if (token) headers.authorization = "Bearer " + token;
  const res = await fetch(url + "/v1/assistant/turn", {method: "POST", headers,
    body: JSON.stringify({session_id: sessionId, text: "yes", action_id: actionId})});
  return {status: res.status, body: await res.json()};
}"""

# From a page: open the WebSocket, authenticate with the given session id and (optional) token, then try a
# "yes"; every message the server sent and the close code (null if it never closed).
_WS_TURN = """([url, sessionId, actionId, token]) => new Promise((resolve) => {
  const ws = new WebSocket(url.replace(/^http/, "ws") + "/v1/assistant/ws");
  const messages = [];
  const auth = {type: "auth", session_id: sessionId};
  if (token) auth.token = token;
  ws.onopen = () => {
    ws.send(JSON.stringify(auth));
    ws.send(JSON.stringify({type: "text", text: "yes", action_id: actionId}));
  };
  ws.onmessage = (ev) => messages.push(JSON.parse(ev.data));
  ws.onclose = (ev) => resolve({code: ev.code, messages});
  setTimeout(() => { resolve({code: null, messages}); ws.close(); }, 5000);
})"""


def test_second_context_without_the_token_cannot_use_the_session(served: Served, browser: Browser):
    context_a, page_a, console_a = new_page(browser)
    context_b, page_b, console_b = new_page(browser)
    try:
        sign_in(page_a, console_a, served)
        ask_transfer(page_a, "send fifty dollars to John Smith", "$50.00 to John Smith")
        session_id = page_a.evaluate("sessionId")
        action_id = page_a.evaluate("pendingAction")
        assert session_id and action_id
        assert served.transfers() == [(5000, "USD", "pending")]

        # B: the same page, but no token in this context's sessionStorage.
        page_b.goto(served.url + "/")
        expect(page_b.locator("#signedout")).to_be_visible()
        expect(page_b.locator("#status")).to_have_text("not signed in")
        say(page_b, "yes")
        expect(page_b.locator("#log .turn").first).to_have_text("⚠ not signed in")
        assert console_b.unexpected() == []

        forged = TokenSigner(secrets.token_bytes(32)).mint("cust-001")  # right customer, wrong key
        other = page_b.evaluate(  # a real token, of another customer
            """async (url) => (await (await fetch(url + "/test-login", {method: "POST",
                 headers: {"content-type": "application/json"},
                 body: JSON.stringify({customer_id: "cust-002"})})).json()).token""",
            served.url,
        )
        for token, status in ((None, 401), (forged, 401), (other, 403)):
            got = page_b.evaluate(_FETCH_TURN, [served.url, session_id, action_id, token])
            assert got["status"] == status, got
            assert "error" in got["body"]

            ws = page_b.evaluate(_WS_TURN, [served.url, session_id, action_id, token])
            assert ws["code"] == 1008, ws
            assert [m["type"] for m in ws["messages"]] == ["error"], ws
            assert ws["messages"][0]["code"] == status
        assert served.transfers() == [(5000, "USD", "pending")]
        assert served.transfers("cust-002") == []
        assert console_b.unexpected(REFUSED_FETCH) == []
        assert len(console_b.errors) == 3  # the three refused fetches, nothing else

        # A's session is untouched: its confirmation still goes through, once.
        click_and_wait(page_a, "#confirm")
        assert "executed" in last_pills(page_a)
        assert served.transfers() == [(5000, "USD", "executed")]
        assert console_a.unexpected() == []
    finally:
        context_b.close()
        context_a.close()


class _OtherSite(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>another site</title><p>nothing here</p>"
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def other_site():
    """A page of another site: served from 127.0.0.1 but opened as http://localhost:PORT, so its origin
    differs from the app's (http://127.0.0.1:PORT) and the browser calls its requests cross-site."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtherSite)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)
    server.server_close()


def test_another_origin_cannot_use_the_session(served: Served, browser: Browser, other_site: str):
    context_a, page_a, console_a = new_page(browser)
    context_x, page_x, _ = new_page(browser)
    try:
        sign_in(page_a, console_a, served)
        ask_transfer(page_a, "send fifty dollars to John Smith", "$50.00 to John Smith")
        session_id = page_a.evaluate("sessionId")
        action_id = page_a.evaluate("pendingAction")
        token = page_a.evaluate("sessionStorage.getItem('g4serve.token')")
        assert served.rejections("http", other_site) == []

        # The worst case: the other site even holds the customer's token and session (stolen elsewhere).
        page_x.goto(other_site + "/")
        body = {"session_id": session_id, "text": "yes", "action_id": action_id}
        # A "simple" request (no CORS preflight): the browser sends it; the server must refuse it.
        page_x.evaluate(
            """async ([url, body]) => { await fetch(url + "/v1/assistant/turn", {method: "POST",
                 mode: "no-cors", headers: {"content-type": "text/plain"}, body: JSON.stringify(body)}); }""",
            [served.url, body],
        )
        # A JSON request with the token: the preflight is refused, so the POST is never sent.
        failed = page_x.evaluate(
            """async ([url, body, token]) => { try { await fetch(url + "/v1/assistant/turn", {method: "POST",
                 headers: {"content-type": "application/json", authorization: "Bearer " + token},
                 body: JSON.stringify(body)}); return null; } catch (e) { return String(e); } }""",
            [served.url, body, token],
        )
        assert failed and "Failed to fetch" in failed
        ws = page_x.evaluate(_WS_TURN, [served.url, session_id, action_id, token])
        assert ws["messages"] == [] and ws["code"] == 1006, ws  # refused before the handshake completed

        refused = served.rejections("http", other_site)
        assert sorted(e["detail"]["method"] for e in refused) == ["OPTIONS", "POST"]
        assert all(e["detail"]["status"] == 403 for e in refused)
        assert len(served.rejections("ws", other_site)) == 1
        assert served.transfers() == [(5000, "USD", "pending")]

        click_and_wait(page_a, "#cancel")
        assert served.transfers() == [(5000, "USD", "cancelled")]
        assert console_a.unexpected() == []
    finally:
        context_x.close()
        context_a.close()
