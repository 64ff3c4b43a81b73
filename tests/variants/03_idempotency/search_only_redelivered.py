"""Wrong: the reference handler, but the gateway's search is asked only on a redelivery (the delivery
count over 1), to spare a search per new payment. A payment charged by a worker killed before recording,
whose message is gone, comes back a day later as the checkout's copy: a new message on its first
delivery, after the key window. Charged again.

Expect: fail charged_once
Says: new message
Says: not only on a redelivery
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
    # Only a redelivery can follow a delivery that charged, or so this worker believes.
    found = await env.find_charges(key) if msg.metadata.num_delivered > 1 else []
    charge = found[0] if found else await env.charge(payment, idempotency_key=key)
    with env.db:
        if env.db.execute("insert into credited values (?) on conflict do nothing", (key,)).rowcount:
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
