"""Checkout commits the order with its outbox row, then waits for good: no customer is ever answered. The
rest of the pipeline is right; the grader places no more orders after the first checkout that did not return.

Expect: fail orders_committed
Says: checkout of o-001 did not return
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import nats.js.errors

INSERT_ORDER = "insert into orders (id, customer, cents) values (:id, :customer, :cents)"
INSERT_OUTBOX = "insert into outbox (order_id, subject, payload, headers) values (:id, :subject, :payload, :headers)"
SAVE = ("insert into positions (relay, outbox_id) values ('r', ?) "
        "on conflict(relay) do update set outbox_id = excluded.outbox_id")


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    try:
        with db:
            db.execute(INSERT_ORDER, order)
            row = {"id": order["id"], "subject": env.subject("orders.placed"),
                   "payload": json.dumps(order).encode(), "headers": json.dumps({"Correlation-Id": correlation_id})}
            db.execute(INSERT_OUTBOX, row)
    finally:
        db.close()
    await asyncio.Event().wait()  # waits for a confirmation that never comes


async def _resume(env: Any, db: Any) -> int:
    r = db.execute("select outbox_id from positions where relay = 'r'").fetchone()
    pos = r[0] if r else 0
    try:
        last = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
        if last.headers and "Nats-Msg-Id" in last.headers:
            pos = max(pos, int(last.headers["Nats-Msg-Id"]))
    except nats.js.errors.NotFoundError:
        pass
    return pos


async def relay(env: Any) -> None:
    db = env.open_store()
    pos = None
    while True:
        try:
            if pos is None:
                pos = await _resume(env, db)
            rows = db.execute("select id, subject, payload, headers from outbox where id > ? order by id", (pos,)).fetchall()
            for oid, subject, payload, headers in rows:
                h = json.loads(headers or "{}")
                h["Nats-Msg-Id"] = str(oid)
                await env.js.publish(subject, payload, headers=h)
                with db:
                    db.execute(SAVE, (oid,))
                pos = oid
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as e:
            pos = None  # ask the stream again: what did it store?
            await asyncio.sleep(0.1)
            continue
        await asyncio.sleep(0.02)
