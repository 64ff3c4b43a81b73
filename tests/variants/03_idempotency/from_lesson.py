"""Wrong: lesson 03's own cells pasted into the lab's file, renamed to env.*. The `processed` table and
its CLAIM and DONE statements (Part 2), and the handler of 'Part 3: the incident, fixed' (the payment
id as the key, the table read before the gateway, the claim and the credit in one transaction). The
lesson's handler acks by itself; payment_worker acks after it here, so those acks are left out.

Nothing in the lesson asks the gateway's search: a payment whose worker died between the charge and
the credit, redelivered after the key window, is charged again.

Expect: fail charged_once
Says: had forgotten the key
Says: search
"""

import json

CREDIT = "insert into ledger (payment_id, account, cents, charge_id) values (:payment_id, :account, :cents, :charge_id)"
CLAIM = "insert into processed (payment_id) values (:payment_id) on conflict do nothing"
DONE = "select 1 from processed where payment_id = :payment_id"


def setup_db(db) -> None:
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    db.execute("create table if not exists processed (payment_id text primary key)")


async def handle_payment(env, msg) -> None:
    p = json.loads(msg.data)
    if env.db.execute(DONE, p).fetchone():
        return  # done before: not even a call to the gateway
    charge = await env.charge(p, idempotency_key=p["payment_id"])
    with env.db:
        if env.db.execute(CLAIM, p).rowcount:
            env.db.execute(CREDIT, {**p, "charge_id": charge["charge_id"]})


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
