"""Lab 07's grader on what no variant's verdict shows: the run's server restarted in place (a stream and
a durable on file storage survive it, a learner's relay rides it out), and the published-once judgement
on hand-made evidence. (What each variant's verdict must say is its `Says:` lines, in test_variants.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from msglab.catalog import course_root
from msglab.graders import pipeline
from msglab.graders.pipeline import Shop, Stored, _one_transaction_check, _published_once_check, _untested
from msglab.grading.harness import Reply, Run
from msglab.grading.scaffold import HeldSpawns
from msglab.grading.verdict import Check
from msglab.world.outbox import SCHEMA, place_order
from msglab.world.payments import open_shop

SOLUTION = course_root() / "solutions" / "07_pipeline" / "pipeline.py"


async def _restart_with_a_relay_running() -> dict[str, object]:
    async with Run("msglab.graders.pipeline", str(SOLUTION), seed=1) as run:
        await pipeline._provision(run.js, run.names)
        path = os.path.join(run.home, "shop.sqlite")
        with contextlib.closing(open_shop(path)) as db:
            db.executescript(SCHEMA)
        run.sandbox.give(Path(path))
        relays = HeldSpawns(run, "relay", lambda n: [], limit=1, params={"db": path})
        relay = await relays.release()
        assert relay is not None
        stream, subject = run.names.stream(pipeline.STREAM), run.names.subject("orders.placed")

        async def stored(n: int) -> bool:
            info = await run.js.stream_info(stream, subjects_filter=subject)
            return int((info.state.subjects or {}).get(subject, 0)) >= n

        def order(n: int) -> None:
            with contextlib.closing(open_shop(path)) as db:
                place_order(db, {"id": f"o-{n}", "customer": "c-1", "cents": 100}, headers={"Correlation-Id": f"t-{n}"})

        order(1)
        assert await run.wait_for(lambda: stored(1), 10)
        assert run.server is not None
        port, pid = run.server.port, run.server.pid
        await run.restart_broker()
        after = await run.js.stream_info(stream)
        durable = await run.js.consumer_info(stream, run.names.durable(pipeline.DURABLE))
        order(2)
        both = await run.wait_for(lambda: stored(2), 15)
        await relays.cancel()
        return {
            "same_port": run.server.port == port,
            "new_process": run.server.pid != pid,
            "kept": after.state.messages,
            "durable": durable.name,
            "both": both,
            "relay_alive": relay.alive,
        }


def test_a_restart_keeps_the_stream_and_durable_and_a_learner_relay_rides_it_out() -> None:
    seen = asyncio.run(_restart_with_a_relay_running())
    assert seen["same_port"] and seen["new_process"], seen
    assert seen["kept"] == 1 and seen["durable"], seen  # file storage: the message and the durable survive
    assert seen["both"] and seen["relay_alive"], seen  # the relay published the next row after the restart


def test_a_row_stored_twice_after_the_outage_is_blamed_on_the_resume_and_a_foreign_msg_id_on_the_id() -> None:
    shop = Shop({"o-1", "o-2"}, {1: "o-1", 2: "o-2"}, {})
    once = [Stored(1.0, 1, "1", "o-1", "t"), Stored(2.0, 2, "2", "o-2", "t")]
    assert _published_once_check(once, shop, 1.5, lambda o: []).passed
    twice = [*once, Stored(3.0, 3, "2", "o-2", "t")]
    check = _published_once_check(twice, shop, 2.5, lambda o: [])
    assert not check.passed and "past the stream's duplicate window" in check.message, check.message
    foreign = [Stored(1.0, 1, "abc", "o-1", "t")]
    check = _published_once_check(foreign, shop, 0.0, lambda o: [])
    assert not check.passed and "not its outbox row's id" in check.message, check.message
    assert json.loads(json.dumps(pipeline.PARAMS)) == pipeline.PARAMS


def test_a_half_written_order_is_named_by_which_half_committed() -> None:
    alone = _one_transaction_check(Shop({"o-1", "o-2"}, {1: "o-1"}, {}), lambda o: [])
    assert not alone.passed and "committed without an outbox row (o-2)" in alone.message, alone.message
    rowless = _one_transaction_check(Shop({"o-1"}, {1: "o-1", 2: "o-2"}, {}), lambda o: [])
    assert not rowless.passed and "never committed (o-2)" in rowless.message, rowless.message
    assert _one_transaction_check(Shop({"o-1"}, {1: "o-1"}, {}), lambda o: []).passed


def test_with_nothing_committed_the_downstream_checks_say_untested_instead_of_passing() -> None:
    check = _untested(Check("no_lost_events", "every committed order's event reaches the stream", True))
    assert not check.passed and check.message.startswith("untested") and check.name == "no_lost_events"


async def _a_probe_forgotten_in_its_own_stream() -> dict[str, object]:
    async with Run("msglab.graders.pipeline", str(SOLUTION), seed=1) as run:
        await pipeline._provision(run.js, run.names)
        await pipeline._provision_probe(run.js, run.names)
        subject, headers = run.names.subject("orders.placed"), {"Nats-Msg-Id": "1"}
        await run.js.publish(subject, b"{}", headers=headers)
        inside = await run.js.publish(subject, b"{}", headers=headers)
        await pipeline._past_window(run, time.time())  # the grader's probe, in the PROBE stream
        after = await run.js.publish(subject, b"{}", headers=headers)
        info = await run.js.stream_info(run.names.stream(pipeline.STREAM))
        return {"inside": inside.duplicate, "after": after.duplicate, "held": info.state.messages}


def test_a_probe_forgotten_in_its_own_stream_means_the_orders_stream_forgot_the_earlier_msg_id() -> None:
    seen = asyncio.run(_a_probe_forgotten_in_its_own_stream())
    assert seen["inside"] and not seen["after"], seen  # dedup expires by time, per stream, same window
    assert seen["held"] == 2, seen  # the learner's stream holds only what was published on orders.placed


def test_with_nothing_committed_one_transaction_says_untested_but_an_outbox_row_alone_is_evidence() -> None:
    nothing = _one_transaction_check(Shop(set(), {}, {}), lambda o: [])
    assert not nothing.passed and nothing.message.startswith("untested"), nothing.message
    rowless = _one_transaction_check(Shop(set(), {1: "o-1"}, {}), lambda o: [])
    assert not rowless.passed and "never committed (o-1)" in rowless.message, rowless.message


def test_the_order_killed_mid_transaction_found_whole_at_the_end_is_a_phantom() -> None:
    shop = Shop({"o-1", "o-2"}, {1: "o-1", 2: "o-2"}, {})
    orders = _placed("o-1", "o-2")
    orders.torn = "o-2"
    check = pipeline._phantom_check(pipeline.Pipeline(None), shop, orders, lambda o: [])  # type: ignore[arg-type]
    assert not check.passed and "something other than checkout wrote them" in check.message, check.message
    orders.torn = ""
    assert pipeline._phantom_check(pipeline.Pipeline(None), shop, orders, lambda o: []).passed  # type: ignore[arg-type]


def test_an_order_the_grader_never_placed_in_the_shop_is_a_phantom_whoever_wrote_it() -> None:
    shop = Shop({"o-1", "o-999"}, {1: "o-1", 2: "o-999"}, {})
    check = pipeline._phantom_check(pipeline.Pipeline(None), shop, _placed("o-1"), lambda o: [])  # type: ignore[arg-type]
    assert not check.passed and "never placed (o-999)" in check.message, check.message


def test_a_checkout_that_hung_fails_orders_committed_but_one_the_grader_killed_does_not() -> None:
    orders = _placed("o-001", "o-002")
    orders.placed["o-001"] = (0.0, "t-1", Reply(ok=False, elapsed=5.0, gone=True))
    shop = Shop({"o-001", "o-002"}, {1: "o-001", 2: "o-002"}, {})
    assert pipeline._committed_check(orders, shop, lambda o: []).passed
    orders.placed["o-002"] = (0.0, "t-2", Reply(ok=False, elapsed=5.0, hung=True))
    orders.stalled = "o-002"
    check = pipeline._committed_check(orders, shop, lambda o: [])
    assert not check.passed and "checkout of o-002 did not return within 5.0 s" in check.message, check.message


def _placed(*ids: str) -> pipeline.Orders:
    orders = pipeline.Orders(None, {})  # type: ignore[arg-type]
    orders.placed = {o: (0.0, f"t-{o}", Reply(ok=True, elapsed=0.01)) for o in ids}
    return orders


class _Told:
    def __init__(self) -> None:
        self.tables: list[str] = []

    def call(self, name: str, key: object = None, **detail: object) -> None:
        self.tables.append(str(detail.get("table")))


def test_the_relay_s_connection_writes_positions_only_and_never_the_schema(tmp_path: Path) -> None:
    path = str(tmp_path / "shop.sqlite")
    with contextlib.closing(open_shop(path)) as db:
        db.executescript(SCHEMA)
    told = _Told()
    db = pipeline._open_store(path, told, "relay")
    refused = []
    for sql in (
        "create table my_position (outbox_id integer)",
        "create temp table t (x integer)",
        "create index i on positions (outbox_id)",
        "create trigger tr after insert on positions begin select 1; end",
        "create view v as select * from positions",
        "drop table orders",
        "insert into orders (id, customer, cents) values ('o-999', 'c', 1)",
        "delete from sqlite_sequence",
    ):
        with contextlib.suppress(sqlite3.DatabaseError):
            db.execute(sql)
            continue
        refused.append(sql)
    with db:
        db.execute("insert into positions (relay, outbox_id) values ('r', 1)")
    db.close()
    assert len(refused) == 8, refused
    assert told.tables == ["positions"]


GUARDED = """
import os, subprocess, sqlite3, sys
from msglab.graders import pipeline
pipeline.before_learner("relay")
tries = {
    "connect": lambda: sqlite3.connect(sys.argv[1]),
    "open_store without the grader": lambda: pipeline._open_store(sys.argv[1], None, "relay"),
    "open_store as checkout": lambda: pipeline._open_store(sys.argv[1], object(), "checkout"),
    "subprocess": lambda: subprocess.run(["true"]),
    "fork": os.fork,
    "system": lambda: os.system("true"),
    "file write": lambda: open(sys.argv[1] + ".pos", "w"),
}
for name, attempt in tries.items():
    try:
        attempt()
    except PermissionError:
        continue
    print("ALLOWED", name)
open(sys.argv[1]).close()  # reading is fine
print("done")
"""


def test_a_learner_process_is_guarded_before_its_file_runs(tmp_path: Path) -> None:
    path = tmp_path / "shop.sqlite"
    with contextlib.closing(open_shop(str(path))) as db:
        db.executescript(SCHEMA)
    out = subprocess.run([sys.executable, "-c", GUARDED, str(path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "done", out.stdout + out.stderr


def _orders(cents: dict[str, int]) -> pipeline.Orders:
    orders = pipeline.Orders(None, {})  # type: ignore[arg-type]
    orders.cents = dict(cents)
    return orders


def test_the_page_must_end_failed_for_the_order_over_the_card_limit_and_that_order_in_the_dlq() -> None:
    shop = Shop({"o-1", "o-2"}, {1: "o-1", 2: "o-2"}, {})
    orders = _orders({"o-1": 1200, "o-2": pipeline.CARD_LIMIT + 100})
    pipe = pipeline.Pipeline(None)  # type: ignore[arg-type]
    dead = pipeline.Dead(pipeline.PAYMENTS_DLQ, "o-2", "t-2", "over the card limit")
    pipe.dead = [dead]
    right = {"o-1": "confirmed", "o-2": "failed"}
    assert pipeline._status_check(pipe, right, shop, orders, lambda o: []).passed
    check = pipeline._status_check(pipe, {"o-1": "confirmed", "o-2": "confirmed"}, shop, orders, lambda o: [])
    assert not check.passed and "o-2 shows confirmed, not failed" in check.message, check.message
    pipe.dead = []
    check = pipeline._status_check(pipe, right, shop, orders, lambda o: [])
    assert not check.passed and "not in the payments DLQ" in check.message, check.message
    check = pipeline._status_check(pipe, None, shop, orders, lambda o: [])
    assert not check.passed and "did not answer" in check.message, check.message


def test_every_committed_order_gets_exactly_one_receipt_of_its_status_and_is_charged_unless_over_the_limit() -> None:
    from msglab.world.email_provider import Sent
    from msglab.world.gateway import Charge

    shop = Shop({"o-1", "o-2"}, {1: "o-1", 2: "o-2"}, {})
    orders = _orders({"o-1": 1200, "o-2": pipeline.CARD_LIMIT + 100})
    pipe = pipeline.Pipeline(None)  # type: ignore[arg-type]
    sent = [Sent("em_1", "o-1", "c@x", "order_confirmation", 1.0), Sent("em_2", "o-2", "c@x", "payment_failed", 1.0)]
    assert pipeline._receipts_check(pipe, sent, {}, shop, orders, lambda o: []).passed
    check = pipeline._receipts_check(pipe, sent[:1] + sent[:1], {}, shop, orders, lambda o: [])
    assert not check.passed and "o-1 got order_confirmation, order_confirmation" in check.message, check.message
    charge = Charge("ch_1", "c-1", 1200, "o-1", "orders-1", 1.0)
    assert pipeline._processed_once_check([charge], shop, orders, lambda o: []).passed
    over = Charge("ch_2", "c-1", pipeline.CARD_LIMIT + 100, "o-2", "orders-2", 1.0)
    check = pipeline._processed_once_check([charge, over], shop, orders, lambda o: [])
    assert not check.passed and "other than never" in check.message, check.message
