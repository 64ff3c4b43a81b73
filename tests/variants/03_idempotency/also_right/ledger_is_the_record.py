"""Right, written differently: no separate dedup table. The ledger itself gets payment_id as its
primary key, so the credit and its record are one row; a duplicate credit is ignored by the database.

Expect: pass
"""

import json


def setup_db(db) -> None:
    db.execute(
        "create table if not exists ledger (payment_id text primary key, account text not null, "
        "cents integer not null, charge_id text not null)"
    )


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    pid = payment["payment_id"]
    if env.db.execute("select charge_id from ledger where payment_id = ?", (pid,)).fetchone():
        return
    found = await env.find_charges(pid)
    charge = found[0] if found else await env.charge(payment, idempotency_key=pid)
    with env.db:
        env.db.execute(
            "insert or ignore into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
            (pid, payment["account"], payment["cents"], charge["charge_id"]),
        )


async def payment_worker(env) -> None:
    setup_db(env.db)
    sub = await env.js.pull_subscribe_bind(env.durable("payments"), env.stream("PAYMENTS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle_payment(env, msg)
            await msg.ack_sync()
