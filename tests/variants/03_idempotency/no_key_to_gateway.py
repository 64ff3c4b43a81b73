"""Wrong variant: dedups in the database correctly but calls the gateway without the key;
a crash after the charge and before the transaction charges again on redelivery."""

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
    # TODO: Use the payment's own id as the idempotency key, so every delivery of this payment has the same key.
    key = payment["payment_id"]
    # TODO: Pass the key to the gateway as idempotency_key, so a repeated charge returns the first charge.
    charge = await env.charge(payment)
    with env.db:  # one transaction: what runs in this block commits together, or not at all
        # TODO: Insert the key into processed first, and return without crediting when it was already there.
        claimed = env.db.execute(
            "insert into processed (payment_id) values (?) on conflict (payment_id) do nothing", (key,)
        ).rowcount
        if claimed == 0:
            return  # an earlier delivery (or the other worker, just now) recorded it: nothing more to do
        env.db.execute(
            "insert into payments (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
            (payment["payment_id"], payment["account"], payment["cents"], charge["charge_id"]),
        )
        env.db.execute(
            "insert into balances (account, cents) values (?, ?) "
            "on conflict (account) do update set cents = cents + excluded.cents",
            (payment["account"], payment["cents"]),
        )
