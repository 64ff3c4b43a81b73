"""Right, written differently: the reference handler, but the worker long-polls as production workers do:
each fetch waits up to 10 s, longer than the grader's idle spell, so the late payment arrives while a
fetch is still open and no empty fetch comes first. A worker waiting inside its fetch is running.

Expect: pass
"""

import json

FETCH_TIMEOUT = 10.0  # seconds a fetch waits for a payment: a long poll, as in production (5-30 s)


def setup_db(db) -> None:
    """Create the shop's tables; every worker runs this when it starts, so it must be safe to repeat."""
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    # The dedup table. Its primary key is what makes it work: the database refuses a second row for one
    # payment, so no code path, and no second worker writing at the same moment, can record it twice.
    db.execute("create table if not exists credited (payment_id text primary key)")


async def handle_payment(env, msg) -> None:
    """Charge one payment and credit it; a redelivery, a copy or a second worker must change nothing more."""
    payment = json.loads(msg.data)  # {"payment_id": "p-03", "account": "acct-2", "cents": 4250}
    # The key names the operation (this payment), not the attempt, the message or the moment: a redelivery
    # a second later and a copy with its own stream sequence carry the same payment_id.
    key = payment["payment_id"]
    # Our own records first. The gateway forgets keys after 24 h; this table forgets nothing, so a copy or a
    # redelivery of a credited payment stops here, however late it comes.
    if env.db.execute("select 1 from credited where payment_id = ?", (key,)).fetchone():
        return
    # Not credited yet, but a delivery before this one may have charged it and died before crediting. After
    # the key window only the gateway's search (by the payment's reference) knows that; inside the window
    # the search may not show a charge made a moment ago, and the key makes the repeat harmless instead.
    # (This asks the search once per new payment. Recording the attempt before charging, and searching only
    # on a delivery that finds an attempt but no credit, is as right and spares the searches.)
    found = await env.find_charges(key)
    charge = found[0] if found else await env.charge(payment, idempotency_key=key)
    # One transaction: the dedup record and the credit commit together or not at all, so a kill leaves both or
    # neither. The insert is the claim: exactly one insert per payment adds a row (rowcount 1). A second worker
    # that passed the check above at the same moment waits for our lock, then changes 0 rows and credits nothing.
    with env.db:
        claimed = env.db.execute(
            "insert into credited (payment_id) values (?) on conflict (payment_id) do nothing", (key,)
        ).rowcount
        if claimed:
            credit(env.db, payment, charge["charge_id"])


def credit(db, payment, charge_id) -> None:
    """Add the payment to the shop's ledger, inside the caller's transaction."""
    db.execute(
        "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
        (payment["payment_id"], payment["account"], payment["cents"], charge_id),
    )


async def payment_worker(env) -> None:
    """Handle payments from the durable one at a time, until the process is stopped (as in labs 01 and 02)."""
    setup_db(env.db)
    sub = await env.js.pull_subscribe_bind(env.durable("payments"), env.stream("PAYMENTS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=FETCH_TIMEOUT)
        except TimeoutError:
            continue  # nothing to do yet: a worker keeps asking
        for msg in msgs:
            await handle_payment(env, msg)
            await msg.ack_sync()  # after the work: a kill before this line means a redelivery
