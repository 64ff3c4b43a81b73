"""Right, written differently: no unique key at all; the worker takes SQLite's write lock with an
explicit BEGIN IMMEDIATE before it looks, so a second worker waits and then sees the first one's row.
Commits and rolls back by hand.

Expect: pass
"""

import json


def setup_db(db) -> None:
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    db.execute("create table if not exists done (payment_id text not null)")


def is_done(db, pid) -> bool:
    return db.execute("select 1 from done where payment_id = ?", (pid,)).fetchone() is not None


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    pid = payment["payment_id"]
    if is_done(env.db, pid):
        return
    found = await env.find_charges(pid)
    charge = found[0] if found else await env.charge(payment, idempotency_key=pid)
    db = env.db
    db.execute("begin immediate")  # the write lock first: whoever looks next waits for our commit
    try:
        if not is_done(db, pid):
            db.execute("insert into done (payment_id) values (?)", (pid,))
            db.execute(
                "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
                (pid, payment["account"], payment["cents"], charge["charge_id"]),
            )
        db.execute("commit")
    except BaseException:
        db.execute("rollback")
        raise


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
