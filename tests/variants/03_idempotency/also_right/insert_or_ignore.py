"""Right, written differently: the dedup table is called seen_payments and claimed with INSERT OR
IGNORE, reading the claim from the cursor's rowcount.

Expect: pass
"""

import json


def setup_db(db) -> None:
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    db.execute("create table if not exists seen_payments (id text not null unique, seen_at real)")


async def handle_payment(env, msg) -> None:
    p = json.loads(msg.data)
    if env.db.execute("select count(*) from seen_payments where id = ?", (p["payment_id"],)).fetchone()[0]:
        return
    earlier = await env.find_charges(p["payment_id"])
    charge = earlier[0] if earlier else await env.charge(p, idempotency_key=p["payment_id"])
    with env.db:
        cur = env.db.execute("insert or ignore into seen_payments (id, seen_at) values (?, julianday('now'))",
                             (p["payment_id"],))
        if cur.rowcount == 1:
            env.db.execute("insert into ledger values (?, ?, ?, ?)",
                           (p["payment_id"], p["account"], p["cents"], charge["charge_id"]))


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
