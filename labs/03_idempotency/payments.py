"""Lab 03: charge and credit every payment exactly once, however often the broker delivers it.

The payment worker takes payments from JetStream, charges each one at the payment gateway and
credits it in the shop's ledger. JetStream delivers at least once: a worker killed before its ack
gets the payment delivered again, the checkout sometimes publishes the same payment twice, two
workers can hold the same payment at the same moment, and a redelivery (or a copy) can come after
the gateway has forgotten its idempotency keys. Today every one of those charges the customer again
and credits them again. The task, as requirements, is in README.md.

What the grader (or the lab notebook) hands you in `env`:
  env.db          a sqlite3 connection to the shop's database (WAL mode and a busy timeout, so two
                  workers wait for each other instead of failing). The grader reads the ledger table.
  await env.charge(payment, idempotency_key=None)
                  charges payment["cents"] to payment["account"] at the gateway, with
                  payment["payment_id"] as the charge's reference; returns a dict with "charge_id"
                  and "replayed". The gateway remembers a key for 24 h: a repeat inside that window
                  gets the first charge back ("replayed": True). A key reused with other parameters
                  raises env.IdempotencyKeyReused.
  await env.find_charges(payment_id)
                  the gateway's search: the charges it made with that reference, as a list of dicts
                  like charge's answer. Like a real gateway's search it lags behind: a charge shows
                  up about a minute after it was made, and it is still there after the key window.
  env.js, env.stream("PAYMENTS"), env.durable("payments")
                  JetStream, and the stream and durable consumer the platform made for you.

Check your work:  msglab check 03   (or run the last cell of lab.ipynb)
"""

import json
import uuid

FETCH_TIMEOUT = 0.5  # seconds a fetch waits for a payment (scaled down: production long-polls 5-30 s)


def setup_db(db) -> None:
    """Create the shop's tables; every worker runs this when it starts, so it must be safe to repeat."""
    db.execute(
        "create table if not exists ledger (payment_id text not null, account text not null, "
        "cents integer not null, charge_id text not null)"
    )
    # TODO: Keep a record of the payments you have credited that two workers writing at the same moment can never both add.


async def handle_payment(env, msg) -> None:
    """Charge one payment and credit it; a redelivery, a copy or a second worker must change nothing more."""
    payment = json.loads(msg.data)  # {"payment_id": "p-03", "account": "acct-2", "cents": 4250}
    # TODO: Send every charge request for one payment under the same idempotency key, whichever delivery or copy sends it.
    key = uuid.uuid4().hex
    # TODO: Make sure a payment you have already credited never reaches the gateway again, even after its key window.
    # TODO: Make sure a delivery that follows one killed between the charge and the credit does not charge again, even after the key window, be it a redelivery or a copy.
    charge = await env.charge(payment, idempotency_key=key)
    # TODO: Credit each payment exactly once, so that a kill at any point leaves its credit and your record of it both written or both missing.
    credit(env.db, payment, charge["charge_id"])


def credit(db, payment, charge_id) -> None:
    """Add the payment to the shop's ledger, and commit."""
    db.execute(
        "insert into ledger (payment_id, account, cents, charge_id) values (?, ?, ?, ?)",
        (payment["payment_id"], payment["account"], payment["cents"], charge_id),
    )
    db.commit()


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
