"""Module 07's outbox and relay on a real server: an order and its outbox row commit together, the relay
publishes rows in order under their outbox id and resumes from its saved position, and, with real relay
processes SIGKILLed between the stream's ack and the saved position, the resend is dropped inside the
duplicate window and stored twice past it. Counts from the database and the stream; no timing."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import nats
import pytest

from msglab.broker.server import EmbeddedServer
from msglab.demos import pipeline
from msglab.world.outbox import Counts, counts, open_store, order_ids, place_order, position
from msglab.world.relay import Relay

ORDERS = [{"id": f"o-{i}", "customer": "c-1", "cents": 100 * i} for i in range(1, 5)]


def test_an_order_and_its_outbox_row_commit_together_or_not_at_all(tmp_path: Path) -> None:
    path = str(tmp_path / "shop.sqlite")
    db = open_store(path)
    assert [place_order(db, order) for order in ORDERS[:2]] == [1, 2]
    with pytest.raises(sqlite3.IntegrityError):
        place_order(db, ORDERS[0])  # the order exists: its outbox row is rolled back with it
    assert (counts(path).orders, counts(path).outbox) == (2, 2)
    with db:
        db.execute("delete from outbox")  # a relay's clean-up: the next id is still never handed out twice
    assert place_order(db, ORDERS[2]) == 3
    db.close()
    assert order_ids(path) == {"o-1", "o-2", "o-3"}
    assert counts(path) == Counts(orders=3, outbox=1, position=0, last=3)


def test_the_relay_publishes_in_order_under_the_outbox_id_and_resumes_from_its_saved_position(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    path = str(tmp_path / "shop.sqlite")

    async def body() -> tuple[int, int, int, list[tuple[str, str]], list[bool]]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="OUTBOX_T", subjects=["outbox_t.>"])
        try:
            db = open_store(path)
            for order in ORDERS[:3]:
                place_order(db, order, "outbox_t.placed")
            first = await Relay(db, js).step()
            idle = await Relay(db, js).step()  # nothing after the saved position
            place_order(db, ORDERS[3], "outbox_t.placed")
            again = Relay(open_store(path), js)  # a new relay process would open the store afresh
            resumed = await again.step()
            held = await pipeline.stored(js, "OUTBOX_T", "outbox_t.placed")
            return first, idle, resumed, held, [s.duplicate for s in again.sent]
        finally:
            await js.delete_stream("OUTBOX_T")
            await nc.close()

    first, idle, resumed, held, duplicates = asyncio.run(body())
    assert (first, idle, resumed) == (3, 0, 1)
    assert held == [("o-1", "1"), ("o-2", "2"), ("o-3", "3"), ("o-4", "4")]  # in order, Nats-Msg-Id = outbox id
    assert duplicates == [False]
    db = open_store(path)
    assert position(db) == 4
    db.close()


def test_a_relay_killed_between_the_ack_and_its_position_resends_and_the_duplicate_window_drops_it(
    no_nats_url: None,
) -> None:
    resend = asyncio.run(pipeline.relay_resend(rows=5, kill_at=3))
    assert resend.answers == [False, True]  # row 3 published twice; the second PubAck says duplicate
    assert resend.copies == {str(i): 1 for i in range(1, 6)}  # and the stream holds it once
    assert resend.stored_twice == []


def test_past_the_duplicate_window_the_resend_is_stored_twice(no_nats_url: None) -> None:
    resend = asyncio.run(pipeline.relay_resend(window=0.5, past_window=True, rows=5, kill_at=3))
    assert resend.answers == [False, False]  # the server had forgotten Msg-Id 3: a new message
    assert resend.copies == {"1": 1, "2": 1, "3": 2, "4": 1, "5": 1}
    assert resend.stored_twice == ["3"]  # only the consumer's dedup table can catch it now
