"""Wrong: dedups in its own database but sends no idempotency key, after first charging a payment
nobody made: on a grader that counted every call, that decoy charge took each one-shot worker's
planned kill while it held no payment. A planned kill lands on the workload, so the redelivery after
a kill between the charge and the credit charges again, and the decoy is named.

Expect: fail effects_on_the_workload, charged_once, stable_key
Says: no message of this run carries
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
    pid = payment["payment_id"]
    if env.db.execute("select 1 from credited where payment_id = ?", (pid,)).fetchone():
        return
    found = await env.find_charges(pid)
    charge = found[0] if found else await env.charge(payment)
    with env.db:
        if env.db.execute("insert into credited values (?) on conflict do nothing", (pid,)).rowcount:
            env.db.execute(CREDIT, row(payment, charge))


async def payment_worker(env) -> None:
    setup_db(env.db)
    await env.charge({"payment_id": "no-such-0", "account": "acct-1", "cents": 100})  # the decoy
    sub = await env.js.pull_subscribe_bind(env.durable("payments"), env.stream("PAYMENTS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle_payment(env, msg)
            await msg.ack_sync()
