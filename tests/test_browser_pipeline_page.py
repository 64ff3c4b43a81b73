"""Lesson 07's status page in a real browser: Debian's Chromium, driven by Playwright, opens the page served
against a real nats-server while the lesson's live shop runs (checkout's outbox, the relay, payments, email),
and watches one order go from pending to confirmed and another, over the card limit, from pending to failed,
as the server pushes each event (server-sent events). Payments is stalled until the browser shows both
orders pending, so the pending state is seen, not guessed. No sleeps: each step waits on the page's state
with a deadline. Without /usr/bin/chromium or Playwright the test skips (Playwright cannot download a browser
here)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import nats
import pytest

from msglab.broker.server import EmbeddedServer
from msglab.demos import pipeline

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
WAIT_MS = 15_000  # the longest one change may take to show (a loaded machine; it takes milliseconds)
T = TypeVar("T")

# Every status each row of the page shows, in order, as the page's own script sets it.
RECORD_JS = """
() => {
  window.seen = {};
  const note = (row) => {
    const list = (window.seen[row.dataset.order] ||= []);
    if (row.dataset.status && list[list.length - 1] !== row.dataset.status) list.push(row.dataset.status);
  };
  new MutationObserver((changes) => changes.forEach((c) => {
    if (c.type === "attributes") note(c.target);
    c.addedNodes.forEach((n) => n.dataset && note(n));
  })).observe(document.getElementById("orders"), {subtree: true, childList: true, attributes: true,
                                                   attributeFilter: ["data-status"]});
}
"""


class Loop:
    """An asyncio loop on a thread of its own (Playwright's sync API owns the test's thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM} (install Debian's chromium to run the browser tests)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def test_the_browser_sees_one_order_go_pending_then_confirmed_and_another_pending_then_failed(
    server: EmbeddedServer, browser: Any
) -> None:
    loop = Loop()
    nc = loop.run(nats.connect(server.url))
    shop = loop.run(pipeline.Shop.open(nc, nc.jetstream()))
    try:
        url = loop.run(shop.page()).url
        tab = browser.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda exc: errors.append(str(exc)))
        tab.goto(url)
        tab.wait_for_function("document.getElementById('link').textContent === 'live'", timeout=WAIT_MS)
        tab.evaluate(RECORD_JS)

        ok = {"id": "b-1", "customer": "c-1", "cents": 1200}
        declined = {"id": "b-2", "customer": "c-2", "cents": pipeline.CARD_LIMIT + 1}
        loop.loop.call_soon_threadsafe(
            shop.stall
        )  # payments waits: both orders stay pending until the browser has shown it
        loop.run(shop.place([ok, declined]))
        for oid in ("b-1", "b-2"):
            tab.wait_for_selector(f'tr[data-order="{oid}"][data-status="pending"]', timeout=WAIT_MS)
        loop.loop.call_soon_threadsafe(shop.release)
        tab.wait_for_selector('tr[data-order="b-1"][data-status="confirmed"]', timeout=WAIT_MS)
        tab.wait_for_selector('tr[data-order="b-2"][data-status="failed"]', timeout=WAIT_MS)
        seen = tab.evaluate("window.seen")
        shown = {row.get_attribute("data-order"): row.inner_text() for row in tab.query_selector_all("tr[data-order]")}
        tab.close()
    finally:
        loop.run(shop.close())
        loop.run(nc.close())
        loop.close()

    assert seen == {"b-1": ["pending", "confirmed"], "b-2": ["pending", "failed"]}
    assert "confirmed" in shown["b-1"] and "failed" in shown["b-2"]
    assert errors == []
