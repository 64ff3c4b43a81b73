"""Five invoice workers to read, not to run: say in invoices.py (GUARANTEES) which guarantee each
gives the invoice. Each handles one invoice request; `charge` calls the invoicing service, `db` is
the billing database (SQLite). Ask, line by line: what if the process is killed here, or `charge`
raises here?
"""

import json


async def core_subscriber(nc, charge):
    """Invoice requests arrive on a plain NATS subject (nc.publish), no stream behind it."""
    sub = await nc.subscribe("billing.invoice")
    async for msg in sub.messages:
        await charge(json.loads(msg.data)["order_id"])


async def ack_then_work(msg, charge):
    """Ack first, so a slow charge is never redelivered."""
    await msg.ack_sync()
    await charge(json.loads(msg.data)["order_id"])


async def work_then_ack(msg, charge):
    """Charge first, then ack."""
    await charge(json.loads(msg.data)["order_id"])
    await msg.ack_sync()


async def ack_in_finally(msg, charge):
    """Charge, and ack whatever happens, so the message never clogs the consumer."""
    try:
        await charge(json.loads(msg.data)["order_id"])
    finally:
        await msg.ack_sync()


async def dedup_then_ack(msg, db):
    """Write the invoice into the billing database, keyed by order id, in one transaction; then ack."""
    order_id = json.loads(msg.data)["order_id"]  # the same on every delivery of this request
    with db:  # one transaction: both rows commit together, or neither does
        claimed = db.execute("insert into processed (order_id) values (?) on conflict do nothing", (order_id,)).rowcount
        if claimed:  # 0 rows: this order was processed before, on an earlier delivery
            db.execute("insert into invoices (order_id) values (?)", (order_id,))
    await msg.ack_sync()
