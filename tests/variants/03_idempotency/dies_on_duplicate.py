"""Wrong: the claim is a plain insert that raises IntegrityError on a duplicate, and nothing catches it:
the second of two workers holding the same payment dies. A duplicate is not an error.

Expect: fail no_unplanned_deaths
"""

import json

LEDGER = (
    "create table if not exists ledger (payment_id text not null, account text not null, "
    "cents integer not null, charge_id text not null)"
)
CREDIT = "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)"


def setup_db(db) -> None:
    db.execute(LEDGER)
    db.execute("create table if not exists credited (payment_id text primary key)")


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    key = payment["payment_id"]
    if env.db.execute("select 1 from credited where payment_id = ?", (key,)).fetchone():
        return
    found = await env.find_charges(key)
    charge = found[0] if found else await env.charge(payment, idempotency_key=key)
    with env.db:
        env.db.execute("insert into credited (payment_id) values (?)", (key,))  # raises on a duplicate
        env.db.execute(CREDIT, (key, payment["account"], payment["cents"], charge["charge_id"]))


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
