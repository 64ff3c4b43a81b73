"""A relay that returns when the outbox is empty: the rows committed after it returned are never published.

Expect: fail no_unplanned_deaths
Says: returned on its own
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.js.errors import NotFoundError

INSERT_ORDER = "insert into orders (id, customer, cents) values (:id, :customer, :cents)"
INSERT_OUTBOX = (
    "insert into outbox (order_id, subject, payload, headers) values (:order_id, :subject, :payload, :headers)"
)
RELAY = "relay"


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    """Place one order (a dict with id, customer, cents); return once it is placed."""
    db = env.open_store()
    try:
        with db:  # one transaction: both rows commit, or neither
            db.execute(INSERT_ORDER, order)
            db.execute(
                INSERT_OUTBOX,
                {
                    "order_id": order["id"],
                    "subject": env.subject("orders.placed"),
                    "payload": json.dumps(order).encode(),
                    "headers": json.dumps({"Correlation-Id": correlation_id}),
                },
            )
    finally:
        db.close()


async def _stream_position(env: Any) -> int:
    """The outbox id of the last event the stream holds on the subject (0 if none)."""
    try:
        last = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
    except NotFoundError:
        return 0
    return int((last.headers or {}).get("Nats-Msg-Id", 0))


def _saved_position(db: Any) -> int:
    row = db.execute("select outbox_id from positions where relay = ?", (RELAY,)).fetchone()
    return row[0] if row else 0


def _save_position(db: Any, outbox_id: int) -> None:
    with db:
        db.execute(
            "insert into positions (relay, outbox_id) values (?, ?) "
            "on conflict(relay) do update set outbox_id = excluded.outbox_id",
            (RELAY, outbox_id),
        )


async def relay(env: Any) -> None:
    """Publish the outbox to the stream, for as long as the process lives."""
    db = env.open_store()
    position = None
    while True:
        try:
            if position is None:  # on start and after any error: resume where the stream is
                position = max(_saved_position(db), await _stream_position(env))
            rows = db.execute(
                "select id, subject, payload, headers from outbox where id > ? order by id", (position,)
            ).fetchall()
            if not rows:
                return
            for outbox_id, subject, payload, headers in rows:
                hdrs = json.loads(headers or "{}")
                hdrs["Nats-Msg-Id"] = str(outbox_id)
                await env.js.publish(subject, payload, headers=hdrs)
                _save_position(db, outbox_id)
                position = outbox_id
        except asyncio.CancelledError:
            raise
        except Exception:
            position = None  # re-read both positions once the server answers again
            await asyncio.sleep(0.1)
            continue
        await asyncio.sleep(0.02)
