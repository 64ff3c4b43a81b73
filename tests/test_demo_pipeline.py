"""Lesson 07's dual write on a real server: a checkout process SIGKILLed between its two writes, in real
processes. Commit-then-publish loses exactly the killed orders, publish-then-commit publishes exactly
them without an order, and the outbox with its relay (itself killed after acks) does neither. Counted
from the shop's database and the stream; no timing."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import nats
import pytest

import msglab
from msglab.broker.server import EmbeddedServer
from msglab.demos import pipeline
from msglab.demos.idempotency import PaymentBench
from msglab.world.outbox import open_store, place_order
from msglab.world.relay import Relay
from msglab.world.status_page import StatusPage

INSERT_ORDER = pipeline.INSERT_ORDER  # a lesson cell's own constant: shipped to the checkout process with its code
CREDIT = "insert into ledger (payment_id, account, cents) values (:payment_id, :account, :cents)"


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


def test_the_live_shop_runs_each_service_as_a_process_and_takes_each_order_to_a_final_status_on_its_page(
    server: EmbeddedServer,
) -> None:
    """Checkout's outbox in this process; the relay, payments, email, the page, the gateway and module 04's email
    provider each a process of its own, on a real server: an order under the card limit ends confirmed with one
    receipt (after the provider's outage, retried), one over it failed, dead-lettered by payments and its receipt
    dead-lettered by email (the mailbox does not exist); the trace holds every hop; a stopped payments process's
    queue deepens by each order and a new one drains it; close() leaves no process, stream or folder behind."""

    async def body() -> dict[str, Any]:
        nc = await nats.connect(server.url)
        shop = await pipeline.Shop.open(nc, nc.jetstream())
        seen: dict[str, Any] = {"pids": {name: s.pid for name, s in shop.services.items()}}
        processes = list(shop.services.values())
        try:
            await shop.provider.outage(nc, 0.2, from_next_request=True)  # the first receipt meets an outage
            await shop.provider.control(nc, "mailbox", address="c-2@example.com", exists=False)
            small = {"id": "o-1", "customer": "c-1", "cents": 1200}
            large = {"id": "o-2", "customer": "c-2", "cents": pipeline.CARD_LIMIT + 1}
            seen["final"] = await shop.settled(await shop.place([small, large]))
            seen["path"] = [hop.what for hop in (await shop.trace("o-1")).hops]
            seen["path2"] = [hop.what for hop in (await shop.trace("o-2")).hops]
            seen["receipts"] = await shop.receipts()
            seen["dlqs"] = await shop.dlqs()
            page = await shop.page()
            seen["shown"] = [(c.order_id, c.status) for c in page.changes]
            shop.stall()
            seen["stalled_alive"] = processes[1].alive
            readings = await shop.watch([{"id": f"o-{i}", "customer": "c-3", "cents": 900} for i in (3, 4, 5)])
            seen["stalled"] = [r.consumers["payments"][0] for r in readings]
            shop.release()
            processes.append(shop.services["payments"])
            await shop.settled(["o-3", "o-4", "o-5"])
            seen["after"] = (await shop.lag()).consumers["payments"][0]
            seen["charged"] = sorted(str(c.reference) for c in shop.gateway.charges())
            seen["page"] = shop.services["status"].orders()
            seen["folder"] = shop.folder
        finally:
            await shop.close()
            seen["left"] = [str(s.config.name) for s in await nc.jetstream().streams_info()]
            seen["alive"] = [p.alive for p in processes]
            await nc.close()
        return seen

    seen = asyncio.run(body())
    assert len(set(seen["pids"].values()) | {os.getpid()}) == 7  # six processes, none of them this one
    assert set(seen["pids"]) == {"relay", "payments", "email", "status", "gateway", "provider"}
    assert seen["final"] == {"o-1": "confirmed", "o-2": "failed"}
    assert seen["dlqs"] == {"payments": 1, "email": 1}  # o-2 refused for good by payments; its receipt by the provider
    receipts = seen["receipts"]
    assert receipts.sent == {"o-1": "order_confirmation"} and receipts.dead == ["o-2"]
    assert receipts.refused.get(503, 0) >= 1 and receipts.refused.get(422) == 1  # retried through the outage
    for hop in ("placed", "status pending", "status confirmed", "shown pending", "shown confirmed",
                "receipt refused: 503", "receipt sent (order_confirmation)"):  # fmt: skip
        assert hop in seen["path"], (hop, seen["path"])
    path = seen["path"]  # oldest first, and each hop after the one that caused it
    assert path[0] == "placed" and path.index("status confirmed") < path.index("receipt sent (order_confirmation)")
    assert {"payments.dlq", "status failed", "shown failed", "receipt refused: 422", "email.dlq"} <= set(seen["path2"])
    assert [s for o, s in seen["shown"] if o == "o-1"] == ["pending", "confirmed"]  # what a browser was pushed
    assert [s for o, s in seen["shown"] if o == "o-2"] == ["pending", "failed"]
    assert seen["stalled_alive"] is False and seen["stalled"] == [1, 2, 3] and seen["after"] == 0
    assert seen["charged"] == ["o-1", "o-3", "o-4", "o-5"]  # each confirmed order charged once, the failed one never
    assert seen["page"] == {"o-1": "confirmed", "o-2": "failed", "o-3": "confirmed", "o-4": "confirmed",
                            "o-5": "confirmed"}  # fmt: skip
    assert not any(seen["alive"])  # close() stopped every process it started, the second payments too
    assert not [name for name in seen["left"] if name.startswith("LESSON07_")] and not os.path.exists(seen["folder"])


def test_a_payments_process_sigkilled_between_charge_and_ack_leaves_the_order_charged_once(
    server: EmbeddedServer,
) -> None:
    """The real payments service, held after its charge and SIGKILLed there: the redelivery goes to a new process,
    which asks the gateway again with the same key and gets the first charge back; the trace shows both requests."""

    async def body() -> tuple[pipeline.Crash, list[str], bool, int]:
        nc = await nats.connect(server.url)
        shop = await pipeline.Shop.open(nc, nc.jetstream())
        try:
            crash = await shop.crash_payments({"id": "o-7", "customer": "c-7", "cents": 700})
            path = [hop.what for hop in (await shop.trace("o-7")).hops]
            return crash, path, shop.services["payments"].pid != crash.pid, len(shop.gateway.charges())
        finally:
            await shop.close()
            await nc.close()

    crash, path, replaced, charges = asyncio.run(body())
    assert (crash.charged_before_kill, crash.charges) == (1, 1)  # charged before the kill, never again
    assert crash.requests >= 2 and crash.replayed == crash.requests - 1  # each redelivery got the first charge back
    assert crash.status == "confirmed" and replaced and charges == 1
    assert path.index("charged") < path.index("charge replayed") < path.index("status confirmed")


def test_the_live_shop_says_which_process_stopped_instead_of_waiting_out_its_deadline(server: EmbeddedServer) -> None:
    async def body() -> str:
        nc = await nats.connect(server.url)
        shop = await pipeline.Shop.open(nc, nc.jetstream())
        try:
            shop.gateway.proc.kill()  # the gateway is gone: payments' charge request has no responder
            await asyncio.to_thread(shop.gateway.proc.wait)
            await shop.place([{"id": "o-9", "customer": "c-9", "cents": 900}])
            with pytest.raises(RuntimeError) as stopped:
                await shop.settled(["o-9"], timeout=60)  # a RuntimeError, not a TimeoutError: nothing waited out
            return str(stopped.value)
        finally:
            await shop.close()
            await nc.close()

    said = asyncio.run(body())
    assert said.startswith("the gateway process (pid ") and "stopped, exit code -9" in said


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


async def charge_without_key(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    await env.nc.request(env.gateway, msg.data, timeout=2)
    env.kill_point("after_charge", p)
    with env.db:
        env.db.execute(CREDIT, p)
    await msg.ack_sync()


async def charge_with_key(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    await env.nc.request(env.gateway, msg.data, timeout=2, headers={"Idempotency-Key": p["payment_id"]})
    env.kill_point("after_charge", p)
    with env.db:
        env.db.execute(CREDIT, p)
    await msg.ack_sync()


def test_the_idempotency_key_alone_stops_every_double_charge_but_not_the_double_credit_of_a_copy(
    no_nats_url: None,
) -> None:
    """Lesson 07's section 3 without the dedup table: the stream holds o-003 twice (a resend past the window) and
    2 workers die after the charge. Without a key both causes charge again; with the key alone the gateway replays
    every second request, and the ledger, the worker's own write, still takes o-003 once per stored copy."""

    async def body() -> tuple[pipeline.Twice, pipeline.Twice, int, int]:
        past = await pipeline.relay_resend(window=0.5, past_window=True)
        nc, js = await msglab.connect()
        bench = await PaymentBench.open(nc, js)
        try:
            plain, keyed = pipeline.as_payments(past.events, "plain"), pipeline.as_payments(past.events, "keyed")
            first = await bench.run(charge_without_key, payments=plain, kill={"after_charge": 2})
            second = await bench.run(charge_with_key, payments=keyed, kill={"after_charge": 2})
            return pipeline.twice(bench, plain), pipeline.twice(bench, keyed), first.kills, second.kills
        finally:
            await bench.close()
            await nc.close()

    without_key, with_key, kills_without, kills_with = asyncio.run(body())
    assert kills_without == kills_with == 2  # the same planned kills fired in both runs
    assert without_key.charged["o-003"] >= 2 and len(without_key.charged) >= 2  # the copy, and each redelivery
    assert with_key.charged == {}  # the key caught the copy stored twice and the redeliveries alike
    assert without_key.credited == with_key.credited == {"o-003": 2}  # one ledger row per stored copy
    assert repr(with_key) == "orders charged twice: none; credited twice: o-003 ×2"
