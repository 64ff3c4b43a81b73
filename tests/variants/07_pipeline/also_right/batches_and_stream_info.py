"""Correct, written differently: checkout opens the transaction itself (BEGIN ... COMMIT, autocommit off),
and the relay publishes a batch of rows, then saves its position once per batch; it resumes after the
larger of its saved position and the Nats-Msg-Id of the stream's last message on the subject, which it
finds from stream_info and get_msg instead of get_last_msg.

Expect: pass
"""

import asyncio
import json

from nats.errors import Error as NatsError


async def checkout(env, order, correlation_id):
    db = env.open_store()
    db.isolation_level = None  # transactions by hand
    try:
        db.execute("begin immediate")
        db.execute(
            "insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
            (order["id"], "orders.placed", json.dumps(order), json.dumps({"Correlation-Id": correlation_id})),
        )
        db.execute(
            "insert into orders (id, customer, cents) values (?, ?, ?)",
            (order["id"], order["customer"], order["cents"]),
        )
        db.execute("commit")
    except BaseException:
        db.execute("rollback")
        raise
    finally:
        db.close()


async def stream_holds(env):
    subject = env.subject("orders.placed")
    info = await env.js.stream_info(env.stream("ORDERS"), subjects_filter=subject)
    if not (info.state.subjects or {}).get(subject):
        return 0
    seq = info.state.last_seq
    while seq >= info.state.first_seq:  # the last message on our subject (others share the stream)
        msg = await env.js.get_msg(env.stream("ORDERS"), seq)
        if msg.subject == subject:
            return int(msg.headers["Nats-Msg-Id"])
        seq -= 1
    return 0


async def relay(env):
    db = env.open_store()
    start = None
    while True:
        try:
            if start is None:
                saved = db.execute("select coalesce(max(outbox_id), 0) from positions").fetchone()[0]
                start = max(saved, await stream_holds(env))
            batch = db.execute(
                "select id, payload, headers from outbox where id > ? order by id limit 5", (start,)
            ).fetchall()
            if not batch:
                await asyncio.sleep(0.03)
                continue
            for row_id, payload, headers in batch:
                hdrs = dict(json.loads(headers))
                hdrs["Nats-Msg-Id"] = str(row_id)
                await env.js.publish(
                    env.subject("orders.placed"),
                    payload if isinstance(payload, bytes) else payload.encode(),
                    headers=hdrs,
                )
            start = batch[-1][0]
            db.execute("insert or replace into positions (relay, outbox_id) values ('relay', ?)", (start,))
            db.commit()
        except (NatsError, TimeoutError):
            start = None
            await asyncio.sleep(0.1)
