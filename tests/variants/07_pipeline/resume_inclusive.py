"""The relay saves the row it is about to publish, then publishes it, and a relay that starts again publishes
the saved row again (trusting Nats-Msg-Id to drop it). Its saved position never lags behind the stream at a
write, so the planned kill lands after a save, before a publish, where this relay is right; but stopped once
idle and started again past the duplicate window, it stores its last row twice.

Expect: fail published_once
Says: after the relay restarted past the stream's duplicate window
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import nats.js.errors

SAVE = ("insert into positions (relay, outbox_id) values ('r', ?) "
        "on conflict(relay) do update set outbox_id = excluded.outbox_id")


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    try:
        with db:
            db.execute("insert into orders (id, customer, cents) values (:id, :customer, :cents)", order)
            db.execute("insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
                       (order["id"], env.subject("orders.placed"), json.dumps(order).encode(),
                        json.dumps({"Correlation-Id": correlation_id})))
    finally:
        db.close()


async def relay(env: Any) -> None:
    db = env.open_store()
    r = db.execute("select outbox_id from positions where relay = 'r'").fetchone()
    nxt = r[0] if r else 1  # the row being (re)published: inclusive
    while True:
        try:
            rows = db.execute("select id, subject, payload, headers from outbox where id >= ? order by id",
                              (nxt,)).fetchall()
            for oid, subject, payload, headers in rows:
                with db:
                    db.execute(SAVE, (oid,))
                h = json.loads(headers or "{}")
                h["Nats-Msg-Id"] = str(oid)
                await env.js.publish(subject, payload, headers=h)
                nxt = oid + 1
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            await asyncio.sleep(0.1)
            continue
        await asyncio.sleep(0.02)
