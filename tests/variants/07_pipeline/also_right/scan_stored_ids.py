"""Right, written differently: the relay saves its position after each ack; at start (and after an error)
it reads the Msg-Ids of every stored order event back (a get_msg walk) and skips rows the stream holds.

Expect: pass
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.js.errors import NotFoundError


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    db.execute("begin immediate")
    try:
        db.execute(
            "insert into orders (id, customer, cents) values (?, ?, ?)",
            (order["id"], order["customer"], order["cents"]),
        )
        db.execute(
            "insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
            (order["id"], "orders.placed", json.dumps(order).encode(), json.dumps({"Correlation-Id": correlation_id})),
        )
        db.commit()
    except BaseException:
        db.rollback()
        raise
    finally:
        db.close()


async def stored_ids(env: Any) -> set[str]:
    ids, seq = set(), 1
    while True:
        try:
            m = await env.js.get_msg(env.stream("ORDERS"), seq, subject=env.subject("orders.placed"), next=True)
        except NotFoundError:
            return ids
        ids.add((m.headers or {}).get("Nats-Msg-Id", ""))
        seq = int(m.seq) + 1


async def relay(env: Any) -> None:
    db = env.open_store()
    held = None
    while True:
        try:
            if held is None:
                held = await stored_ids(env)
            saved = db.execute("select outbox_id from positions where relay = 'main'").fetchone()
            pos = saved[0] if saved else 0
            rows = db.execute(
                "select id, subject, payload, headers from outbox where id > ? order by id", (pos,)
            ).fetchall()
            if not rows:
                await asyncio.sleep(0.03)
                continue
            for row_id, subject, payload, headers in rows:
                if str(row_id) not in held:
                    await env.js.publish(
                        env.subject(subject), payload, headers={**json.loads(headers), "Nats-Msg-Id": str(row_id)}
                    )
                    held.add(str(row_id))
                db.execute("replace into positions (relay, outbox_id) values ('main', ?)", (row_id,))
                db.commit()
        except Exception:
            held = None
            await asyncio.sleep(0.1)
