"""The lesson's relay (it resumes from its saved position alone), its position save hidden behind an SQL
comment and followed by a dummy write to positions: the relay's kill is aimed at its writes to positions as
SQLite sees them, so it still lands after an ack and before the save.

Expect: fail published_once
Says: after the relay restarted past the stream's duplicate window
"""

import asyncio
import json

from nats.errors import Error as NatsError

INSERT_ORDER = "insert into orders (id, customer, cents) values (:id, :customer, :cents)"
INSERT_OUTBOX = "insert into outbox (order_id, subject, payload, headers) values (:id, :subject, :payload, :headers)"


def event(order):
    return json.dumps({"id": order["id"], "customer": order["customer"], "cents": order["cents"]}).encode()


def place_order(db, order, subject="orders.placed", headers=None):
    with db:
        db.execute(INSERT_ORDER, order)
        row = {"id": order["id"], "subject": subject, "payload": event(order), "headers": json.dumps(headers or {})}
        return int(db.execute(INSERT_OUTBOX, row).lastrowid or 0)


async def checkout(env, order, correlation_id):
    db = env.open_store()
    place_order(db, order, headers={"Correlation-Id": correlation_id})
    db.close()


def position(db, relay="relay"):
    found = db.execute("select outbox_id from positions where relay = ?", (relay,)).fetchone()
    return int(found[0]) if found else 0


def save_position(db, outbox_id, relay="relay"):
    with db:
        db.execute(
            "/* hidden */ insert into positions (relay, outbox_id) values (?, ?) "
            "on conflict (relay) do update set outbox_id = excluded.outbox_id",
            (relay, outbox_id),
        )
    with db:  # where the grader's kill lands: after the save
        db.execute("update positions set outbox_id = outbox_id where relay = 'nobody'")


def pending(db, after, limit=100):
    rows = db.execute(
        "select id, order_id, subject, payload, headers from outbox where id > ? order by id limit ?", (after, limit)
    )
    return list(rows)


async def step(env, db):
    done = 0
    while rows := pending(db, position(db)):
        for row_id, _, subject, payload, headers in rows:
            await env.js.publish(
                env.subject(subject), payload, headers={**json.loads(headers), "Nats-Msg-Id": str(row_id)}
            )
            save_position(db, row_id)
            done += 1
    return done


async def relay(env):
    db = env.open_store()
    while True:
        try:
            if not await step(env, db):
                await asyncio.sleep(0.02)
        except (NatsError, TimeoutError):
            await asyncio.sleep(0.1)
