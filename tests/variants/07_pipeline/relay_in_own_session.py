"""The lesson's relay (position in memory) run by a grandchild in a session of its own, so the grader's SIGKILL
of the relay's process group would miss it, while the relay process the grader sees writes a lagging position
for the planned kill to land on. Lab 07's processes start no other process: the Popen is refused.

Expect: fail no_unplanned_deaths
Says: start no other process
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

CHILD = r'''
import asyncio, json, os, sqlite3, sys
async def main():
    import nats
    opts = {"inbox_prefix": os.environ["MSGLAB_INBOX"]} if os.environ.get("MSGLAB_INBOX") else {}
    nc = await nats.connect(os.environ["NATS_URL"], max_reconnect_attempts=-1, reconnect_time_wait=0.1, **opts)
    js = nc.jetstream()
    db = sqlite3.connect("file:" + sys.argv[1] + "?mode=ro", uri=True, timeout=5)
    pos = 0
    while True:
        try:
            for oid, subject, payload, headers in db.execute(
                    "select id, subject, payload, headers from outbox where id > ? order by id", (pos,)).fetchall():
                h = json.loads(headers or "{}"); h["Nats-Msg-Id"] = str(oid)
                await js.publish(subject, payload, headers=h)
                pos = oid
        except Exception:
            await asyncio.sleep(0.1); continue
        await asyncio.sleep(0.02)
asyncio.run(main())
'''


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


async def relay(env: Any) -> None:
    db = env.open_store()
    if db.execute("select count(*) from positions").fetchone()[0]:  # a later relay: idles
        await asyncio.Event().wait()
    subprocess.Popen([sys.executable, "-c", CHILD, env.db_path], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = env.open_store()
    while True:  # a position that always lags, for the grader's kill to land on
        with db:
            db.execute("insert into positions (relay, outbox_id) values ('r', 0) "
                       "on conflict(relay) do update set outbox_id = 0")
        await asyncio.sleep(0.02)
