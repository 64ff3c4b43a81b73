"""Right, written differently: the worker records an attempt before it charges (its own transaction),
and asks the gateway's search only on a delivery whose attempt is recorded but not its credit: the
one case where a charge may exist that the key can no longer find. A status column, not two tables.

Expect: pass
"""

import json


def setup_db(db) -> None:
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    db.execute("create table if not exists payment_state (payment_id text primary key, state text not null)")


def state_of(db, pid):
    row = db.execute("select state from payment_state where payment_id = ?", (pid,)).fetchone()
    return row[0] if row else None


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    pid = payment["payment_id"]
    state = state_of(env.db, pid)
    if state == "credited":
        return
    charge = None
    if state == "charging":  # an earlier delivery got as far as the gateway: it may have charged, then died
        found = await env.find_charges(pid)
        charge = found[0] if found else None
    if charge is None:
        with env.db:
            env.db.execute("insert or ignore into payment_state (payment_id, state) values (?, 'charging')", (pid,))
        charge = await env.charge(payment, idempotency_key=pid)
    with env.db:
        moved = env.db.execute(
            "update payment_state set state = 'credited' where payment_id = ? and state = 'charging'", (pid,)
        ).rowcount
        if moved:
            env.db.execute(
                "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
                (pid, payment["account"], payment["cents"], charge["charge_id"]),
            )


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
