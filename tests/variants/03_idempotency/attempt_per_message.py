"""Wrong: the worker records each attempt before it charges and asks the gateway's search only when the
message in hand has an attempt recorded, but it records the attempt under the message's stream sequence,
not the payment. Every redelivery finds its attempt; the checkout's copy a day later, a new message
with a sequence of its own, finds none while an earlier message of the payment was charged: charged again.

Expect: fail charged_once
Says: new message
Says: stream sequence
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
    db.execute("create table if not exists attempts (seq integer primary key)")


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    pid = payment["payment_id"]
    seq = msg.metadata.sequence.stream  # the message, not the payment
    if env.db.execute("select 1 from credited where payment_id = ?", (pid,)).fetchone():
        return
    found = []
    if env.db.execute("select 1 from attempts where seq = ?", (seq,)).fetchone():
        found = await env.find_charges(pid)  # this message reached the gateway before: it may have charged
    else:
        with env.db:
            env.db.execute("insert or ignore into attempts (seq) values (?)", (seq,))
    charge = found[0] if found else await env.charge(payment, idempotency_key=pid)
    with env.db:
        if env.db.execute("insert into credited values (?) on conflict do nothing", (pid,)).rowcount:
            env.db.execute(CREDIT, (pid, payment["account"], payment["cents"], charge["charge_id"]))


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
