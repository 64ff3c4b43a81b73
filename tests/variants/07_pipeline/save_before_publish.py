"""A relay that saves its position before it publishes the row (and resumes from the saved position alone):
at most once. Killed after a save and before the stream stored that row, its successor starts after it,
and the row is never published.

Expect: fail no_lost_events
Says: saved a row before the stream stored it
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    try:
        with db:
            db.execute(
                "insert into orders (id, customer, cents) values (?, ?, ?)",
                (order["id"], order["customer"], order["cents"]),
            )
            db.execute(
                "insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
                (
                    order["id"],
                    "orders.placed",
                    json.dumps(order).encode(),
                    json.dumps({"Correlation-Id": correlation_id}),
                ),
            )
    finally:
        db.close()


async def relay(env: Any) -> None:
    db = env.open_store()
    saved = db.execute("select outbox_id from positions where relay = 'r'").fetchone()
    position = saved[0] if saved else 0
    while True:
        rows = db.execute(
            "select id, subject, payload, headers from outbox where id > ? order by id", (position,)
        ).fetchall()
        if not rows:
            await asyncio.sleep(0.02)
            continue
        for row_id, subject, payload, headers in rows:
            with db:  # save first: "I am about to publish row_id" (wrong order)
                db.execute(
                    "insert into positions (relay, outbox_id) values ('r', ?) "
                    "on conflict (relay) do update set outbox_id = excluded.outbox_id",
                    (row_id,),
                )
            while True:
                try:
                    await env.js.publish(
                        env.subject(subject), payload, headers={**json.loads(headers), "Nats-Msg-Id": str(row_id)}
                    )
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            position = row_id
