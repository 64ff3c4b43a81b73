"""The relay's module opens the shop's database with sqlite3.connect at import time, before any role code
runs, to write an order of its own through a connection without the course's authorizer. The guard is in
place before the learner's file is imported: the connect is refused.

Expect: fail file_imports
Says: env.open_store() only
"""
from __future__ import annotations
import asyncio, json, os, sqlite3, subprocess, sys
from typing import Any
import nats.errors, nats.js.errors
HOW = "importtime"
EARLY = None
if HOW == "importtime" and os.environ.get("MSGLAB_ROLE") == "relay":
    EARLY = sqlite3.connect(os.path.join(os.environ.get("HOME", "."), "shop.sqlite"), timeout=5)
FORGE = [("insert into orders (id, customer, cents) values ('o-999', 'c-1', 500)", ()),
         ("insert into outbox (order_id, subject, payload, headers) values ('o-999', ?, ?, '{}')", None)]

async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    db = env.open_store()
    try:
        with db:
            db.execute("insert into orders (id, customer, cents) values (:id, :customer, :cents)", order)
            db.execute("insert into outbox (order_id, subject, payload, headers) values (?, ?, ?, ?)",
                       (order["id"], env.subject("orders.placed"), json.dumps(order).encode(),
                        json.dumps({"Correlation-Id": correlation_id})))
    finally:
        db.close()

def forge(env: Any) -> None:
    payload = json.dumps({"id": "o-999", "customer": "c-1", "cents": 500}).encode()
    subj = env.subject("orders.placed")
    if HOW == "subproc":
        code = ("import sqlite3,sys; db=sqlite3.connect(sys.argv[1], timeout=5); "
                "db.execute(\"insert into orders (id, customer, cents) values ('o-999','c-1',500)\"); "
                "db.execute(\"insert into outbox (order_id, subject, payload, headers) values ('o-999', ?, ?, '{}')\", (sys.argv[2], sys.argv[3].encode())); db.commit()")
        subprocess.run([sys.executable, "-c", code, env.db_path, subj, payload.decode()], check=True)
        return
    db = EARLY if HOW == "importtime" else env.open_store()
    if HOW == "classmethod":
        sqlite3.Connection.set_authorizer(db, None)
    with db:
        db.execute(FORGE[0][0])
        db.execute(FORGE[1][0], (subj, payload))

async def relay(env: Any) -> None:
    forge(env)
    db = env.open_store()
    pos = None
    while True:
        try:
            if pos is None:
                r = db.execute("select max(outbox_id) from positions").fetchone()
                pos = r[0] or 0
                try:
                    last = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
                    pos = max(pos, int(last.headers["Nats-Msg-Id"]))
                except nats.js.errors.NotFoundError:
                    pass
            for oid, subject, payload, headers in db.execute(
                    "select id, subject, payload, headers from outbox where id > ? order by id", (pos,)).fetchall():
                h = json.loads(headers or "{}"); h["Nats-Msg-Id"] = str(oid)
                await env.js.publish(subject, payload, headers=h)
                with db:
                    db.execute("insert into positions (relay, outbox_id) values ('r', ?) on conflict(relay) do update set outbox_id = excluded.outbox_id", (oid,))
                pos = oid
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            pos = None
            await asyncio.sleep(0.1)
            continue
        await asyncio.sleep(0.02)
