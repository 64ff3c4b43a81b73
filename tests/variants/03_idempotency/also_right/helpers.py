"""Right, written differently: small helper functions, a dedup table called idempotency_log keyed by
the payment id, and the credit as a helper that runs inside the caller's transaction.

Expect: pass
"""

import json
import sqlite3


def setup_db(db: sqlite3.Connection) -> None:
    db.executescript(
        """
        create table if not exists ledger (payment_id text not null, account text not null,
                                           cents integer not null, charge_id text not null);
        create table if not exists idempotency_log (payment_key text primary key, charge_id text);
        """
    )


def already_credited(db, key: str) -> bool:
    return bool(db.execute("select 1 from idempotency_log where payment_key = ?", (key,)).fetchall())


async def charge_once(env, payment: dict, key: str) -> dict:
    """The gateway's earlier charge for this payment if its search knows one, else a charge under our key."""
    for earlier in await env.find_charges(payment["payment_id"]):
        return earlier
    return await env.charge(payment, idempotency_key=key)


def claim(db, key: str, charge_id: str) -> bool:
    cur = db.cursor()
    cur.execute(
        "insert into idempotency_log (payment_key, charge_id) values (?, ?) on conflict do nothing", (key, charge_id)
    )
    return cur.rowcount > 0


def add_to_ledger(db, payment: dict, charge_id: str) -> None:
    db.execute(
        "insert into ledger (payment_id, account, cents, charge_id) values (:payment_id, :account, :cents, :charge)",
        {**payment, "charge": charge_id},
    )


async def handle_payment(env, msg) -> None:
    payment = json.loads(msg.data)
    key = f"payment:{payment['payment_id']}"
    if already_credited(env.db, key):
        return
    charge = await charge_once(env, payment, key)
    with env.db:
        if claim(env.db, key, charge["charge_id"]):
            add_to_ledger(env.db, payment, charge["charge_id"])


async def payment_worker(env) -> None:
    setup_db(env.db)
    sub = await env.js.pull_subscribe_bind(env.durable("payments"), env.stream("PAYMENTS"))
    while True:
        try:
            batch = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in batch:
            await handle_payment(env, msg)
            await msg.ack_sync()
