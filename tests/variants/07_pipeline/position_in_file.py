"""The lesson's relay (it resumes from its saved position alone, never asks the stream), its position kept in
a file first and then in `positions`, so a kill before the `positions` write would land after the file's.
Lab 07's relay writes no file: the open is refused.

Expect: fail no_unplanned_deaths
Says: write no file
"""
from __future__ import annotations

import asyncio
import json
import os
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
    path = os.path.join(os.path.dirname(env.db_path), "relay.pos")
    try:
        pos = int(open(path).read())
    except (OSError, ValueError):
        pos = 0
    while True:
        try:
            rows = db.execute("select id, subject, payload, headers from outbox where id > ? order by id",
                              (pos,)).fetchall()
            for oid, subject, payload, headers in rows:
                h = json.loads(headers or "{}")
                h["Nats-Msg-Id"] = str(oid)
                await env.js.publish(subject, payload, headers=h)
                with open(path, "w") as f:
                    f.write(str(oid))
                with db:
                    db.execute(SAVE, (oid,))
                pos = oid
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            await asyncio.sleep(0.1)
            continue
        await asyncio.sleep(0.02)
