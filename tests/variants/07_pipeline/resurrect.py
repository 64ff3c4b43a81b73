"""Publish then commit (the phantom event) with the evidence repaired: checkout publishes first, then
commits; the relay copies every stream event whose order is missing back into orders and outbox, so the
order whose checkout was killed mid-transaction would reappear in the database (the relay may write only its
positions: refused).

Expect: fail no_phantom_events
Says: the shop's database does not hold
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.js.errors import NotFoundError


async def _last_id(env: Any) -> int:
    try:
        m = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
        return int((m.headers or {}).get("Nats-Msg-Id", 0))
    except NotFoundError:
        return 0


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    try:
        top = db.execute("select coalesce(max(id), 0) from outbox").fetchone()[0]
        rid = max(top, await _last_id(env)) + 1
        headers = {"Correlation-Id": correlation_id}
        while True:
            try:
                await env.js.publish(
                    env.subject("orders.placed"),
                    json.dumps(order).encode(),
                    headers={**headers, "Nats-Msg-Id": str(rid)},
                )
                break
            except Exception:
                await asyncio.sleep(0.1)
        with db:
            db.execute(
                "insert or ignore into orders (id, customer, cents) values (?, ?, ?)",
                (order["id"], order["customer"], order["cents"]),
            )
            db.execute(
                "insert or ignore into outbox (id, order_id, subject, payload, headers) values (?, ?, ?, ?, ?)",
                (rid, order["id"], "orders.placed", json.dumps(order).encode(), json.dumps(headers)),
            )
    finally:
        db.close()


async def relay(env: Any) -> None:
    db = env.open_store()
    seq = 1
    while True:
        try:
            while True:
                try:
                    m = await env.js.get_msg(env.stream("ORDERS"), seq, subject=env.subject("orders.placed"), next=True)
                except NotFoundError:
                    break
                seq = int(m.seq) + 1
                order = json.loads(m.data)
                if not db.execute("select 1 from orders where id = ?", (order["id"],)).fetchone():
                    h = {"Correlation-Id": (m.headers or {}).get("Correlation-Id", "")}
                    with db:  # make the phantom real
                        db.execute(
                            "insert into orders (id, customer, cents) values (?, ?, ?)",
                            (order["id"], order["customer"], order["cents"]),
                        )
                        db.execute(
                            "insert or ignore into outbox (id, order_id, subject, payload, headers) "
                            "values (?, ?, ?, ?, ?)",
                            (int(m.headers["Nats-Msg-Id"]), order["id"], "orders.placed", m.data, json.dumps(h)),
                        )
            with db:  # a heartbeat: where the grader's relay kill lands
                db.execute(
                    "insert into positions (relay, outbox_id) values ('hb', 0) "
                    "on conflict (relay) do update set outbox_id = outbox_id + 1"
                )
        except Exception:
            pass
        await asyncio.sleep(0.02)
