"""The lesson 03 bench on a real server: handlers run in real worker processes, kills are real
SIGKILLs (an open transaction dies with its process), and the race of two workers is decided by
the primary key alone. Counts and states only, no timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats.errors
import sqlite_utils

import msglab
from msglab.demos.idempotency import PaymentBench

CREDIT = "insert into ledger (payment_id, account, cents) values (:payment_id, :account, :cents)"
CLAIM = "insert into processed (payment_id) values (:payment_id) on conflict do nothing"
DONE = "select 1 from processed where payment_id = :payment_id"


async def handle_naive(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    await env.nc.request(env.gateway, msg.data, timeout=2)
    env.kill_point("after_charge", p)
    with env.db:
        env.db.execute(CREDIT, p)
    await msg.ack_sync()


async def record_then_work(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    with env.db:
        claimed = env.db.execute(CLAIM, p).rowcount
    env.kill_point("between", p)
    if claimed:
        with env.db:
            env.db.execute(CREDIT, p)
    await msg.ack_sync()


async def one_transaction(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    with env.db:
        claimed = env.db.execute(CLAIM, p).rowcount
        env.kill_point("between", p)  # the SIGKILL lands inside the open transaction
        if claimed:
            env.db.execute(CREDIT, p)
    env.kill_point("before_ack", p)
    await msg.ack_sync()


async def handle_payment(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    if env.db.execute(DONE, p).fetchone():
        await msg.ack_sync()
        return
    env.kill_point("before_charge", p)
    await env.nc.request(env.gateway, msg.data, timeout=2, headers={"Idempotency-Key": p["payment_id"]})
    env.kill_point("after_charge", p)
    with env.db:
        if env.db.execute(CLAIM, p).rowcount:
            env.db.execute(CREDIT, p)
    env.kill_point("before_ack", p)
    await msg.ack_sync()


async def credit_once(env: Any, msg: Any) -> None:
    p = json.loads(msg.data)
    if env.db.execute(DONE, p).fetchone():
        await msg.ack_sync()
        return
    env.hold(p)
    with env.db:
        if env.db.execute(CLAIM, p).rowcount:
            env.db.execute(CREDIT, p)
    await msg.ack_sync()


async def with_bench(body: Any) -> Any:
    nc, js = await msglab.connect()
    bench = await PaymentBench.open(nc, js)
    try:
        return await body(bench)
    finally:
        await bench.close()
        await nc.close()


def test_kills_after_the_charge_double_charge_exactly_the_killed_payments(no_nats_url: None) -> None:
    async def body(bench: PaymentBench) -> Any:
        return await bench.run(handle_naive, payments=12, kill={"after_charge": 4})

    naive = asyncio.run(with_bench(body))
    assert naive.kills == 4
    assert (naive.double_charged, naive.never_charged) == (4, 0)
    assert (naive.credited_twice, naive.never_credited) == (0, 0)
    assert naive.charges == 16 and naive.deliveries == 16


def test_a_kill_inside_the_transaction_rolls_the_claim_back(no_nats_url: None) -> None:
    async def body(bench: PaymentBench) -> Any:
        sqlite_utils.Database(bench.db_path).table("processed").create({"payment_id": str}, pk="payment_id")
        return await asyncio.gather(
            bench.run(record_then_work, payments=12, kill={"between": 3}),
            bench.run(one_transaction, payments=12, kill={"between": 3, "before_ack": 3}),
        )

    record_first, atomic = asyncio.run(with_bench(body))
    assert record_first.kills == 3 and (record_first.never_credited, record_first.credited_twice) == (3, 0)
    assert atomic.kills == 6 and (atomic.never_credited, atomic.credited_twice) == (0, 0)


def test_the_fixed_handler_survives_kills_everywhere_and_a_replay_after_the_key_window(no_nats_url: None) -> None:
    async def body(bench: PaymentBench) -> Any:
        sqlite_utils.Database(bench.db_path).table("processed").create({"payment_id": str}, pk="payment_id")
        fixed = await bench.run(handle_payment, payments=12, kill={"before_charge": 2, "after_charge": 2,
                                                                   "before_ack": 2})  # fmt: skip
        assert bench.gateway is not None
        await bench.gateway.advance(bench.nc, hours=25)
        return fixed, await bench.run(handle_payment, payments=fixed.batch)

    fixed, replay = asyncio.run(with_bench(body))
    assert fixed.kills == 6
    assert (fixed.double_charged, fixed.never_charged, fixed.credited_twice, fixed.never_credited) == (0, 0, 0, 0)
    assert replay.charges == 0 and replay.credited_twice == 0 and replay.kills == 0


def test_only_the_primary_key_decides_a_race_of_two_worker_processes(no_nats_url: None) -> None:
    async def body(bench: PaymentBench) -> Any:
        loose, strict = bench.new_shop(), bench.new_shop()
        loose["processed"].create({"payment_id": str})
        strict["processed"].create({"payment_id": str}, pk="payment_id")
        try:
            return await asyncio.gather(bench.race(credit_once, loose), bench.race(credit_once, strict))
        finally:
            loose.close()
            strict.close()

    no_key, with_key = asyncio.run(with_bench(body))
    assert no_key.met == with_key.met == 3  # every payment was held by both workers at once
    assert no_key.deliveries == with_key.deliveries == 6
    assert (no_key.credited_twice, no_key.never_credited) == (3, 0)
    assert (with_key.credited_twice, with_key.never_credited) == (0, 0)


def test_a_timed_out_charge_was_made_and_the_key_guards_retries(no_nats_url: None) -> None:
    async def body(bench: PaymentBench) -> Any:
        nc = bench.nc
        slow = await bench.slow_gateway(latency=0.3)
        payment = json.dumps({"payment_id": "t-1", "account": "acct-1", "cents": 700}).encode()
        with contextlib.suppress(nats.errors.TimeoutError):
            await nc.request(slow.subject, payment, timeout=0.05)
            raise AssertionError("the slow gateway answered before the timeout")
        await slow.quiet()
        charged = len(slow.charges("t-1"))

        def ask(data: bytes, timeout: float) -> Any:
            return nc.request(slow.subject, data, timeout=timeout, headers={"Idempotency-Key": "t-2"})

        body_ = json.dumps({"payment_id": "t-2", "account": "acct-1", "cents": 700}).encode()
        with contextlib.suppress(nats.errors.TimeoutError):
            await ask(body_, 0.05)
        in_flight = json.loads((await ask(body_, 2)).data)
        await slow.quiet()
        after = json.loads((await ask(body_, 2)).data)
        other = json.loads((await ask(body_.replace(b"700", b"800"), 2)).data)
        return charged, in_flight, after, other, len(slow.charges("t-2"))

    charged, in_flight, after, other, t2_charges = asyncio.run(with_bench(body))
    assert charged == 1  # the caller timed out; the card was charged anyway
    assert in_flight["status"] == 409 and in_flight["code"] == "idempotency_key_in_use"
    assert after["replayed"] is True
    assert other["status"] == 400 and other["code"] == "idempotency_key_reused"
    assert t2_charges == 1
