"""Lab 03: charge every payment exactly once, however often the broker delivers it.

The payment worker takes payments from JetStream, charges each one at the payment gateway and
credits it in the shop's database. JetStream delivers at least once: a worker killed before its
ack gets the payment delivered again, a slow worker's payment goes to a second worker while the
first is still on it, and the checkout sometimes publishes the same payment twice. Today every
one of those charges the customer again. Make the effect happen once: a stable idempotency key,
a dedup record written in the same transaction as the credit, and the key passed to the gateway.

What the grader hands you in `env`:
  env.db                  a sqlite3 connection to the shop's database (WAL mode, busy_timeout set);
                          `with env.db:` is one transaction: it commits at the end, or rolls back
                          if the block raises (or the process dies inside it)
  env.charge(payment, idempotency_key=None)
                          charges payment["cents"] to payment["account"] at the payment gateway
                          (a NATS request to gateway.charge, the key in an Idempotency-Key header);
                          returns {"charge_id": ..., "replayed": ...}
  env.nc, env.js          the NATS connection and its JetStream context (not needed here)

The worker loop around handle_payment is the grader's: it fetches one message at a time from the
durable "payments" and acks it once handle_payment returns (ack after the work, as in lab 01).

Check your work:  msglab check 03   (or run the last cell of lab.ipynb)
"""

import json
import uuid


def setup_db(db) -> None:
    """Create the tables; every worker calls this when it starts, so it must be safe to repeat."""
    db.execute("create table if not exists balances (account text primary key, cents integer not null)")
    db.execute(
        "create table if not exists payments (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    # TODO: Create a processed table whose primary key is payment_id, so a payment can be recorded only once.


async def handle_payment(env, msg) -> None:
    """Charge one payment and credit it, with the same effect however often msg is delivered."""
    payment = json.loads(msg.data)
    # TODO: Use the payment's own id as the idempotency key, so every delivery of this payment has the same key.
    key = uuid.uuid4().hex
    # TODO: Pass the key to the gateway as idempotency_key, so a repeated charge returns the first charge.
    charge = await env.charge(payment)
    with env.db:  # one transaction: what runs in this block commits together, or not at all
        # TODO: Insert the key into processed first, and return without crediting when it was already there.
        env.db.execute(
            "insert into payments (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
            (payment["payment_id"], payment["account"], payment["cents"], charge["charge_id"]),
        )
        env.db.execute(
            "insert into balances (account, cents) values (?, ?) "
            "on conflict (account) do update set cents = cents + excluded.cents",
            (payment["account"], payment["cents"]),
        )
