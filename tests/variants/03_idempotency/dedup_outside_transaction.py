"""Wrong: the dedup record is committed in a transaction of its own, before the charge and the credit.
A kill between the two transactions leaves the payment recorded as done and never credited.

Expect: fail none_lost
"""

import json

LEDGER = (
    "create table if not exists ledger (payment_id text not null, account text not null, "
    "cents integer not null, charge_id text not null)"
)
CREDIT = "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)"


def row(payment, charge):
    return (payment["payment_id"], payment["account"], payment["cents"], charge["charge_id"])


def setup_db(db) -> None:
    db.execute(LEDGER)
    db.execute("create table if not exists credited (payment_id text primary key)")


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    key = payment["payment_id"]
    with env.db:  # transaction 1: the claim, alone
        claimed = env.db.execute(
            "insert into credited (payment_id) values (?) on conflict (payment_id) do nothing", (key,)
        ).rowcount
    if not claimed:
        return
    found = await env.find_charges(key)
    charge = found[0] if found else await env.charge(payment, idempotency_key=key)
    with env.db:  # transaction 2: the credit, too late to be undone with the claim
        env.db.execute(CREDIT, row(payment, charge))


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
