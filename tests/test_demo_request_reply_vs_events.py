"""Lesson 01's storefront (msglab.world.storefront), the one model of its services that the lesson's
demo, the lab's playground and grader 01 share, on a real server.

The lesson's own plumbing (Responder, the order desk, the chain) is tests/test_lesson_plumbing.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import pytest

import msglab
from msglab.broker.server import EmbeddedServer
from msglab.demos import request_reply_vs_events as demo
from msglab.graders import request_reply_vs_events as grader
from msglab.grading.labkit import Names
from msglab.world.storefront import INVENTORY, LOYALTY_ASK, Responder, Storefront


def test_the_lesson_the_playground_and_the_grader_share_one_responder() -> None:
    assert demo.Responder is Responder
    assert grader.Storefront is Storefront


def test_inventory_and_loyalty_answer_ignore_and_read_events_as_the_lab_says(server: EmbeddedServer) -> None:
    names = Names("storefront")
    seen: list[tuple[str, str, str | None]] = []
    event_read = asyncio.Event()

    def record(kind: str, name: str, oid: str | None, **detail: Any) -> None:
        seen.append((kind, name, oid))
        if detail.get("via") == "event":
            event_read.set()

    async def body() -> tuple[list[Any], list[tuple[str, str]]]:
        nc, js = await msglab.connect(server.url)
        shop = Storefront(
            nc, js, names, record,
            no_stock={"sku-0"}, silent_skus={"sku-9"}, silent_ids={"o-2"}, ids_by_sku={"sku-9": "o-9"},
        )  # fmt: skip
        answers: list[Any] = []
        try:
            for topology in (grader.EMAIL_TOPOLOGY, grader.LOYALTY_TOPOLOGY):
                await topology.provision(js, names)
            await shop.start()

            async def ask(subject: str, order: dict[str, Any], timeout: float = 5.0) -> Any:
                try:
                    reply = await nc.request(names.subject(subject), json.dumps(order).encode(), timeout=timeout)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                    return type(exc).__name__
                return json.loads(reply.data)

            answers.append(await ask(INVENTORY, {"id": "o-1", "sku": "sku-1", "qty": 1}))
            answers.append(await ask(INVENTORY, {"id": "o-3", "sku": "sku-0", "qty": 1}))
            answers.append(await ask(INVENTORY, {"sku": "sku-9"}, timeout=0.2))  # silent for that sku
            answers.append(await ask(LOYALTY_ASK, {"id": "o-1"}))
            answers.append(await ask(LOYALTY_ASK, {"id": "o-2"}, timeout=0.2))  # silent for that order
            await shop.set("inventory", "down")
            answers.append(await ask(INVENTORY, {"id": "o-4", "sku": "sku-4"}))
            await js.publish(names.subject("orders.placed"), json.dumps({"id": "o-5"}).encode())
            await asyncio.wait_for(event_read.wait(), 5)  # loyalty reads it from its own durable...
            info = await demo.wait_until_waiting(js, names.stream("ORDERS"), names.durable("loyalty"), 0)
            answers.append(info.num_pending + info.num_ack_pending)  # ... and acks it
            with pytest.raises(ValueError, match="service 'inventory' or 'loyalty'"):
                await shop.set("email", "down")
        finally:
            await shop.stop()
            await js.delete_stream(names.stream("ORDERS"))
            await nc.close()
        return answers, shop.awarded

    answers, awarded = asyncio.run(body())
    assert answers == [
        {"reserved": True},
        {"reserved": False},
        "TimeoutError",  # silent: the request arrived, no answer came
        {"ok": True},
        "TimeoutError",
        "NoRespondersError",  # down: nobody listens, the server says so at once
        0,  # the event read from loyalty's durable was acked there
    ]
    assert awarded == [("o-1", "request"), ("o-5", "event")]
    assert ("note", "inventory_ignored", "o-9") in seen  # a request naming only its sku is told apart by it
    assert ("note", "loyalty_ignored", "o-2") in seen and ("effect", "award_points", "o-5") in seen
