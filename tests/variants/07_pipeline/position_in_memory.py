"""The relay keeps its position in memory only and trusts the stream's dedup: a relay that starts again
publishes every row from the first one, which the stream drops only inside its duplicate window. Past it,
each row is stored again and charged again. (It writes nothing to the database, so the grader's planned
kill of the first relay cannot land either.)

Expect: fail published_once, faults_fired
Says: after the relay restarted past the stream's duplicate window
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.errors import Error as NatsError

CORRELATION_ID = "Correlation-Id"
MSG_ID = "Nats-Msg-Id"


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


async def relay(env: Any) -> None:
    """Publish every outbox row in order, each acked by the stream; its position lives in memory only."""
    db = env.open_store()
    position = 0  # a fresh relay starts from the first row and trusts the stream's dedup for the rest
    while True:
        try:
            rows = db.execute(
                "select id, subject, payload, headers from outbox where id > ? order by id limit 100", (position,)
            ).fetchall()
            if not rows:
                await asyncio.sleep(0.02)
                continue
            for row_id, subject, payload, headers in rows:
                await env.js.publish(
                    env.subject(subject), payload, headers={**json.loads(headers), MSG_ID: str(row_id)}
                )
                position = row_id
        except (NatsError, TimeoutError):
            await asyncio.sleep(0.1)
