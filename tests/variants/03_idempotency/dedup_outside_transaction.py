"""Wrong variant: the dedup record is committed in its own transaction, before the charge and the credit;
a crash between the two transactions leaves the payment marked done but never credited."""

import json


def setup_db(db) -> None:
    """Create the tables; every worker calls this when it starts, so it must be safe to repeat."""
    db.execute("create table if not exists balances (account text primary key, cents integer not null)")
    db.execute(
        "create table if not exists payments (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    # TODO: Create a processed table whose primary key is payment_id, so a payment can be recorded only once.
    db.execute("create table if not exists processed (payment_id text primary key)")


async def handle_payment(env, msg) -> None:
    """Charge one payment and credit it, with the same effect however often msg is delivered."""
    payment = json.loads(msg.data)
    key = payment["payment_id"]
    with env.db:  # transaction 1: claim the key
        claimed = env.db.execute(
            "insert into processed (payment_id) values (?) on conflict (payment_id) do nothing", (key,)
        ).rowcount
    if claimed == 0:
        return
    charge = await env.charge(payment, idempotency_key=key)
    with env.db:  # transaction 2: the effect, too late to be undone with the claim
        env.db.execute(
            "insert into payments (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
            (payment["payment_id"], payment["account"], payment["cents"], charge["charge_id"]),
        )
        env.db.execute(
            "insert into balances (account, cents) values (?, ?) "
            "on conflict (account) do update set cents = cents + excluded.cents",
            (payment["account"], payment["cents"]),
        )
