"""The dual write: checkout commits the order with its outbox row, then publishes the event itself; the
relay publishes nothing (it writes a heartbeat into positions). Killed right after its commit, checkout
never publishes that order, and nothing else will.

Expect: fail no_lost_events
Says: SIGKILLed by the grader right after its commit
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
            cur = db.execute(
                "insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
                (
                    order["id"],
                    "orders.placed",
                    json.dumps(order).encode(),
                    json.dumps({"Correlation-Id": correlation_id}),
                ),
            )
            row_id = cur.lastrowid
    finally:
        db.close()
    # the dual write: publish after the commit, in checkout
    while True:
        try:
            await env.js.publish(
                env.subject("orders.placed"),
                json.dumps(order).encode(),
                headers={"Correlation-Id": correlation_id, "Nats-Msg-Id": str(row_id)},
            )
            return
        except Exception:
            await asyncio.sleep(0.1)


async def relay(env: Any) -> None:
    db = env.open_store()
    while True:
        with db:
            db.execute(
                "insert into positions (relay, outbox_id) values ('hb', 0) "
                "on conflict (relay) do update set outbox_id = outbox_id + 1"
            )
        await asyncio.sleep(0.02)
