"""The solution with a checkout that answers 4.6 s after its commit: slow, never hung. Every order would
keep the grader waiting just under the 5 s a call may take; once the checkouts took 10 s in all the grader
stops the call, places no more orders, and the verdict comes in seconds, not past the run's 45 s.

Expect: fail orders_committed
Says: did not return
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

CORRELATION_ID = "Correlation-Id"
MSG_ID = "Nats-Msg-Id"
RELAY = "relay"


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    """Place one order: the order and its outbox row commit together, or neither does."""
    db = env.open_store()
    try:
        with db:  # one transaction: a kill between the two inserts leaves neither
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
                    json.dumps({CORRELATION_ID: correlation_id}),
                ),
            )
    finally:
        db.close()
    await asyncio.sleep(4.6)  # slow, never hung


async def last_in_stream(env: Any) -> int:
    """The highest outbox id the stream already holds (0: none): its last event's Nats-Msg-Id."""
    try:
        msg = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
    except NotFoundError:
        return 0
    return int((msg.headers or {}).get(MSG_ID, 0))


async def relay(env: Any) -> None:
    """Publish every outbox row in order, each acked by the stream; resume after a crash without a resend."""
    db = env.open_store()
    position = None
    while True:
        try:
            if position is None:  # at start: the saved position can lag behind the stream (killed after an ack)
                saved = db.execute("select outbox_id from positions where relay = ?", (RELAY,)).fetchone()
                position = max(saved[0] if saved else 0, await last_in_stream(env))
            rows = db.execute(
                "select id, subject, payload, headers from outbox where id > ? order by id limit 100", (position,)
            ).fetchall()
            if not rows:
                await asyncio.sleep(0.02)  # a poller's wait for new rows
                continue
            for row_id, subject, payload, headers in rows:
                await env.js.publish(
                    env.subject(subject), payload, headers={**json.loads(headers), MSG_ID: str(row_id)}
                )
                with db:
                    db.execute(
                        "insert into positions (relay, outbox_id) values (?, ?) "
                        "on conflict (relay) do update set outbox_id = excluded.outbox_id",
                        (RELAY, row_id),
                    )
                position = row_id
        except (NatsError, TimeoutError):
            position = None  # the server was away (a restart): what it stored meanwhile is asked again
            await asyncio.sleep(0.1)
