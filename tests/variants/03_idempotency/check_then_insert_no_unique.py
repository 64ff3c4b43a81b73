"""Wrong: the dedup table has no unique key; the worker looks, then inserts. Two workers holding the
same payment at once both look before either inserts, and both credit it.

Expect: fail credited_once
Says: two workers held it at the same moment
Says: held there until a second worker
Says: unique key
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
    db.execute("create table if not exists credited (payment_id text not null)")  # nothing refuses a second row


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    key = payment["payment_id"]
    if env.db.execute("select 1 from credited where payment_id = ?", (key,)).fetchone():
        return
    found = await env.find_charges(key)
    charge = found[0] if found else await env.charge(payment, idempotency_key=key)
    with env.db:
        if env.db.execute("select 1 from credited where payment_id = ?", (key,)).fetchone():
            return  # seen, but only if the other worker has already committed
        env.db.execute("insert into credited (payment_id) values (?)", (key,))
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
