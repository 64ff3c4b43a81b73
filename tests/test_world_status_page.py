"""Module 07's status page on a real server, read over real HTTP: status events published on NATS reach an
open server-sent event stream as they happen (pending, then confirmed or failed), a late 'pending' never
sets a final order back, a browser that connects later gets the current state first, and a page started
after the events (from a stream) shows every order. No timers: each read waits for the next event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats

from msglab.broker.server import EmbeddedServer
from msglab.world.status_page import StatusPage, publish_status

READ = 10.0  # the longest one event may take to arrive (a loaded machine; it takes milliseconds)


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event, as the stream delivers them."""
    name, data = "message", ""
    while line := (await asyncio.wait_for(response.content.readline(), READ)).decode():
        line = line.rstrip("\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line:
            yield name, json.loads(data)
            name, data = "message", ""


def test_the_page_pushes_each_order_from_pending_to_confirmed_or_failed(server: EmbeddedServer) -> None:
    async def body() -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict[str, str], str, str]:
        nc = await nats.connect(server.url)
        shop = await nats.connect(server.url)  # the services that decide a status, on their own connection
        page = await StatusPage.start(nc, subject="t1.status.>")
        try:
            async with aiohttp.ClientSession() as http:
                html = await (await http.get(page.url)).text()
                first = await http.get(page.url + "events")  # headers back: this browser is registered
                events = sse_events(first)
                seen: list[tuple[str, str]] = []
                for order_id, status in [("o-1", "pending"), ("o-2", "pending"), ("o-1", "confirmed"),
                                         ("o-1", "pending"), ("o-2", "failed")]:  # fmt: skip
                    await publish_status(shop, order_id, status, prefix="t1.status")
                for _ in range(4):  # the late pending of o-1 is not shown: the fourth event is o-2's failure
                    name, data = await anext(events)
                    seen.append((data["id"], data["status"]))
                    assert name == "order"
                late = await http.get(page.url + "events")  # a browser opened now gets the state first
                again = sse_events(late)
                snapshot = [(d["id"], d["status"]) for _, d in [await anext(again), await anext(again)]]
                state = await (await http.get(page.url + "orders")).json()
                first.close()
                late.close()
                return seen, snapshot, state, html, page.url
        finally:
            await page.stop()
            await nc.close()
            await shop.close()

    seen, snapshot, state, html, url = asyncio.run(body())
    assert seen == [("o-1", "pending"), ("o-2", "pending"), ("o-1", "confirmed"), ("o-2", "failed")]
    assert sorted(snapshot) == [("o-1", "confirmed"), ("o-2", "failed")]
    assert state == {"o-1": "confirmed", "o-2": "failed"}
    assert 'new EventSource("events")' in html and url.startswith("http://127.0.0.1:")


def test_a_page_started_after_the_events_reads_them_from_the_stream(server: EmbeddedServer) -> None:
    async def body() -> tuple[dict[str, str], list[str]]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="STATUS_T2", subjects=["t2.status.>"])
        try:
            for order_id, status in [("o-7", "pending"), ("o-8", "pending"), ("o-7", "failed"), ("o-8", "confirmed")]:
                await js.publish(f"t2.status.{order_id}", json.dumps({"id": order_id, "status": status}).encode())
            page = await StatusPage.start(nc, subject="t2.status.>", stream="STATUS_T2")
            try:
                async with aiohttp.ClientSession() as http:
                    stream = await http.get(page.url + "events")
                    events = sse_events(stream)
                    shown: dict[str, str] = {}
                    while shown != {"o-7": "failed", "o-8": "confirmed"}:  # each read waits for the next event
                        _, data = await anext(events)
                        shown[data["id"]] = data["status"]
                    stream.close()
                return page.orders, [f"{c.order_id} {c.status}" for c in page.changes]
            finally:
                await page.stop()
        finally:
            await js.delete_stream("STATUS_T2")
            await nc.close()

    orders, changes = asyncio.run(body())
    assert orders == {"o-7": "failed", "o-8": "confirmed"}
    assert changes == ["o-7 pending", "o-8 pending", "o-7 failed", "o-8 confirmed"]
