"""Checkout commits the order and its outbox row in two transactions, its real writes hidden behind an SQL
comment and preceded by dummy writes to orders (to steer a kill counted by statements). The grader's kill is
aimed at the first write to a second table, as SQLite itself sees it: it lands between the two commits.

Expect: fail one_transaction
Says: committed without an outbox row
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
    db = env.open_store()
    try:
        for _ in range(2):  # what the grader counts
            with db:
                db.execute("update orders set cents = cents where id = 'none'")
        with db:  # transaction 1: the order
            db.execute(
                "/* o */ insert into orders (id, customer, cents) values (?, ?, ?)",
                (order["id"], order["customer"], order["cents"]),
            )
        with db:  # transaction 2: its outbox row
            db.execute(
                "/* x */ insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
                (
                    order["id"],
                    "orders.placed",
                    json.dumps(order).encode(),
                    json.dumps({CORRELATION_ID: correlation_id}),
                ),
            )
    finally:
        db.close()


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
