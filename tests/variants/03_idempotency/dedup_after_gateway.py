"""Wrong: the dedup table is consulted only after the gateway call, trusting the idempotency key to
make a repeat harmless. A copy of a credited payment published a day later, after the gateway forgot
the key, is charged again.

Expect: fail charged_once
Says: of 10 payments were charged more than once
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
    charge = await env.charge(payment, idempotency_key=key)
    with env.db:
        if env.db.execute("insert into credited values (?) on conflict do nothing", (key,)).rowcount:
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
