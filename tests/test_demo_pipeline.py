"""Lesson 07's dual write on a real server: a checkout process SIGKILLed between its two writes, in real
processes. Commit-then-publish loses exactly the killed orders, publish-then-commit publishes exactly
them without an order, and the outbox with its relay (itself killed after acks) does neither. Counted
from the shop's database and the stream; no timing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import nats
import pytest

from msglab.broker.server import EmbeddedServer
from msglab.demos import pipeline
from msglab.world.outbox import open_store, place_order
from msglab.world.relay import Relay
from msglab.world.status_page import StatusPage

INSERT_ORDER = pipeline.INSERT_ORDER  # a lesson cell's own constant: shipped to the checkout process with its code


def test_each_dual_write_breaks_as_taught_and_the_outbox_breaks_neither_way(no_nats_url: None) -> None:
    async def body() -> list[pipeline.DualWrite]:
        return [
            await pipeline.dual_write("commit_then_publish", orders=30, kills=4, seed=1),
            await pipeline.dual_write("publish_then_commit", orders=30, kills=4, seed=1),
            await pipeline.dual_write("with_outbox", orders=30, kills=4, relay_kills=2, seed=1),
        ]

    commit_first, publish_first, outbox = asyncio.run(body())
    for result in (commit_first, publish_first, outbox):
        assert len(result.killed) == result.kills == 4  # every planned kill fired, each on its order
    assert commit_first.killed == publish_first.killed == outbox.killed  # the same seed, the same orders

    assert (commit_first.committed, commit_first.published) == (30, 26)
    assert commit_first.lost == commit_first.killed and commit_first.phantom == []  # orders nobody hears of

    assert (publish_first.committed, publish_first.published) == (26, 30)
    assert publish_first.phantom == publish_first.killed and publish_first.lost == []  # events for no order

    assert outbox.relay_kills == 2  # the relay died twice after an ack, before saving its position
    assert (outbox.committed, outbox.published) == (26, 26)  # a killed checkout's transaction rolled back whole
    assert (outbox.lost, outbox.phantom, outbox.twice) == ([], [], [])  # the resends were dropped by the window

    shown = repr(pipeline.table(commit_first, publish_first, outbox))
    assert shown.splitlines()[0].split()[:3] == ["checkout", "orders", "killed"]
    assert shown.splitlines()[1].split() == ["commit_then_publish", "30", "4", "0", "30", "26", "4", "0", "0"]
    assert "<td><code>with_outbox</code></td><td>30</td><td>4</td><td>2</td>" in outbox._repr_html_()


def test_a_checkout_written_in_a_lesson_cell_runs_the_same_way(no_nats_url: None) -> None:
    async def commit_both_then_publish(env: Any, order: dict[str, Any]) -> None:
        with env.db:
            env.db.execute(INSERT_ORDER, order)
        await env.js.publish(env.placed, json.dumps(order).encode())
        env.kill_point("between", order)  # killed after both writes: nothing is lost

    result = asyncio.run(pipeline.dual_write(commit_both_then_publish, orders=10, kills=2, seed=3))
    assert result.variant == "commit_both_then_publish" and len(result.killed) == 2
    assert (result.committed, result.published, result.lost, result.phantom) == (10, 10, [], [])


def test_one_orders_correlation_id_is_carried_across_every_hop_and_its_trace_rebuilt(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body() -> tuple[pipeline.Trace, pipeline.Trace, list[str]]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="TRACE_T", subjects=["t5.>"])
        page = await StatusPage.start(nc, subject="t5.status.>", stream="TRACE_T")
        try:
            db = open_store(str(tmp_path / "shop.sqlite"))
            for order in pipeline.make_orders(2):
                place_order(db, order, "t5.placed", headers=pipeline.carry(start=order["id"]))  # checkout
            await Relay(db, js).step()  # the relay publishes the row's headers as they are
            for seq, status in ((1, "confirmed"), (2, "failed")):  # payments, then the status it decided
                placed = await js.get_msg("TRACE_T", seq)
                order_id = json.loads(placed.data or b"")["id"]
                charged = await js.publish("t5.charged", placed.data or b"", headers=pipeline.carry(placed))
                await js.publish(f"t5.status.{order_id}", json.dumps({"id": order_id, "status": status}).encode(),
                                 headers=pipeline.carry(placed))  # fmt: skip
                assert not charged.duplicate
            await page.shown("o-001", "confirmed")
            await page.shown("o-002", "failed")
            one = await pipeline.trace(js, "o-001", ["TRACE_T"], page)
            two = await pipeline.trace(js, "o-002", ["TRACE_T"], page)
            return one, two, repr(one).splitlines()
        finally:
            await page.stop()
            await js.delete_stream("TRACE_T")
            await nc.close()

    one, two, shown = asyncio.run(body())
    assert [hop.what for hop in one.hops] == ["t5.placed", "t5.charged", "t5.status.o-001", "shown confirmed"]
    assert [hop.what for hop in two.hops] == ["t5.placed", "t5.charged", "t5.status.o-002", "shown failed"]
    assert [hop.where for hop in one.hops[:3]] == ["TRACE_T #1", "TRACE_T #3", "TRACE_T #4"]  # the server's records
    assert shown[0].startswith("o-001: 4 hops in ") and "t5.charged" in shown[2] and len(shown) == 5
    with pytest.raises(ValueError, match="Correlation-Id"):
        pipeline.carry({})  # a hop with nothing to carry and nothing to start from


def test_a_checkout_that_fails_on_its_own_stops_the_run_instead_of_being_counted(no_nats_url: None) -> None:
    async def declines(env: Any, order: dict[str, Any]) -> None:
        raise ValueError(f"card declined for {order['id']}")

    with pytest.raises(RuntimeError, match=r"checkout of o-001 raised ValueError\(card declined for o-001\)"):
        asyncio.run(pipeline.dual_write(declines, orders=3, kills=0))


def test_the_live_shop_takes_each_order_through_every_hop_to_a_final_status_on_its_page(
    server: EmbeddedServer,
) -> None:
    """Checkout's outbox, the relay, payments (dedup table, idempotency key), email and the page, in one
    process on a real server: an order under the card limit ends confirmed with a receipt, one over it failed
    and dead-lettered; its trace holds every hop; a stalled payments consumer's queue deepens by each order."""

    left: list[str] = []

    async def body() -> tuple[dict[str, str], Any, int, list[int], list[int], str]:
        nc = await nats.connect(server.url)
        shop = await pipeline.Shop.open(nc, nc.jetstream())
        try:
            page = await shop.page()
            small = {"id": "o-1", "customer": "c-1", "cents": 1200}
            large = {"id": "o-2", "customer": "c-2", "cents": pipeline.CARD_LIMIT + 1}
            final = await shop.settled(await shop.place([small, large]))
            path = await shop.trace("o-1")
            dlq = await shop.dlq_depth()
            shop.stall()
            readings = await shop.watch([{"id": f"o-{i}", "customer": "c-3", "cents": 900} for i in (3, 4, 5)])
            stalled = [r.consumers["payments"][0] for r in readings]
            shop.release()
            await shop.settled(["o-3", "o-4", "o-5"])
            after = (await shop.lag()).consumers["payments"][0]
            charges = [c.reference for c in shop._gateway.charges()]
            return final, path, dlq, stalled, [after], ",".join(sorted(str(c) for c in charges)) + page.url[:4]
        finally:
            await shop.close()
            left.extend(str(s.config.name) for s in await nc.jetstream().streams_info())
            await nc.close()

    final, path, dlq, stalled, after, charged = asyncio.run(body())
    assert final == {"o-1": "confirmed", "o-2": "failed"}
    assert dlq == 1
    what = [hop.what for hop in path.hops]
    assert what[0] in ("lesson07.orders.placed", "lesson07.orders.status.o-1")  # both rows of one transaction
    for hop in ("lesson07.orders.placed", "lesson07.orders.status.o-1", "lesson07.orders.email.sent.o-1",
                "shown pending", "shown confirmed"):  # fmt: skip
        assert hop in what, (hop, path)
    assert stalled == [1, 2, 3] and after == [0]  # nothing paid while stalled; all of it once released
    assert charged == "o-1,o-3,o-4,o-5http"  # each confirmed order charged once, the failed one never
    assert not [name for name in left if name.startswith("LESSON07_")]  # close() leaves no stream behind


def test_the_live_shop_says_which_service_stopped_instead_of_waiting_out_its_deadline(server: EmbeddedServer) -> None:
    async def body() -> str:
        nc = await nats.connect(server.url)
        shop = await pipeline.Shop.open(nc, nc.jetstream())
        try:
            await shop._gateway.stop()  # the gateway is gone: payments' charge request has no responder
            await shop.place([{"id": "o-9", "customer": "c-9", "cents": 900}])
            with pytest.raises(RuntimeError) as stopped:
                await shop.settled(["o-9"])
            return str(stopped.value)
        finally:
            shop._gateway = None
            await shop.close()
            await nc.close()

    said = asyncio.run(body())
    assert said.startswith("lesson07_payments stopped on lesson07.orders.placed: NoRespondersError")


def test_a_relay_resend_is_dropped_inside_the_duplicate_window_and_stored_twice_past_it(no_nats_url: None) -> None:
    """The server's own answers: the PubAck of the resend says duplicate inside the window, new past it; the
    stream then holds that order twice, and the resend's events list it twice (what payments will receive)."""

    async def body() -> tuple[pipeline.Resend, pipeline.Resend]:
        return await pipeline.relay_resend(), await pipeline.relay_resend(window=0.5, past_window=True)

    inside, past = asyncio.run(body())
    assert inside.answers == [False, True] and inside.stored_twice == [] and inside.copies["3"] == 1
    assert past.answers == [False, False] and past.stored_twice == ["3"]
    assert [o["id"] for o in past.events] == ["o-001", "o-002", "o-003", "o-003", "o-004", "o-005"]
    assert [p["payment_id"] for p in pipeline.as_payments(past.events, "t")][2:4] == ["t-o-003", "t-o-003"]


def test_the_servers_default_duplicate_window_is_read_from_a_stream_made_without_one(server: EmbeddedServer) -> None:
    async def body() -> tuple[float, list[str]]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        try:
            window = await pipeline.default_duplicate_window(js)
            return window, [str(s.config.name) for s in await js.streams_info()]
        finally:
            await nc.close()

    window, left = asyncio.run(body())
    assert window == pipeline.DEFAULT_WINDOW == 120.0  # nats-server's default: two minutes
    assert pipeline.PROBE_STREAM not in left
