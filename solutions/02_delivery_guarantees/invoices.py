"""Lab 02: an invoice worker that never loses an invoice.

Every order needs its invoice: a lost one is revenue nobody collects, a second one is a customer
on the phone. Invoice requests wait on a durable consumer; your worker takes them, asks the
invoicing service to issue each invoice, and tells the broker and the billing dashboard when a
request is done. The grader kills the worker (SIGKILL) at the worst moments and starts it again,
and the invoicing service does not always say yes.

What your worker is handed in `env` (by the grader, or by the lab notebook):
  env.js                         a JetStream context (env.nc is its connection)
  env.stream("BILLING")          the stream of invoice requests (it exists already)
  env.durable("invoicer")        your durable consumer on it (it exists already; ack_wait 0.4 s)
  await env.send_invoice(oid)    asks the invoicing service to issue the invoice for order oid (a big
                                 one takes it longer than ack_wait);
                                 when it does not, it raises env.ServiceUnavailable or
                                 env.AccountClosed (both subclasses of env.InvoicingError)
  env.settled(oid)               the billing dashboard counts oid's invoice as done
  env.reject(oid, reason)        hands oid to the billing team: it can never be invoiced, and why

Check your work:  msglab check 02   (or run the last cell of lab.ipynb)
"""

import asyncio
import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"  # can lose a message, and can also process one twice

# Which guarantee does each worker in workers.py give the invoice? One of the four names above.
GUARANTEES = {
    "core_subscriber": AT_MOST_ONCE,  # nothing keeps a core NATS message for a worker that is down
    "ack_then_work": AT_MOST_ONCE,  # a kill between the ack and the charge loses the invoice
    "work_then_ack": AT_LEAST_ONCE,  # a kill between the charge and the ack charges it again
    "ack_in_finally": NEITHER,  # a failed charge is acked anyway (lost), a kill before the ack redoes it
    "dedup_then_ack": EFFECTIVELY_ONCE,  # redelivered, but the processed row makes the second time a no-op
}


async def invoice_worker(env) -> None:
    """Invoice every request on the durable, forever (the grader kills and restarts this process)."""
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.25)
        except TimeoutError:  # nothing to do yet: ask again (returning here would stop all invoicing)
            continue
        for msg in msgs:
            await handle(env, msg)


async def keep_claim(msg, work):
    """Await `work`, telling the broker every 0.1 s (well within ack_wait, 0.4 s) that msg is still being worked on.

    An invoice can take longer than ack_wait; without a sign of life the broker hands the request to another
    worker while this one still works on it. The sign must go out while the call runs, so it runs beside it.
    """

    async def beat():
        while True:
            await asyncio.sleep(0.1)
            await msg.in_progress()  # restarts the redelivery timer: nobody else is handed the request meanwhile

    beating = asyncio.create_task(beat())
    try:
        return await work
    finally:
        beating.cancel()


async def handle(env, msg) -> None:
    order_id = json.loads(msg.data)["order_id"]
    try:
        await keep_claim(msg, env.send_invoice(order_id))
    except env.ServiceUnavailable:
        # The service cannot take it *now*; the same request will go through later. No ack: after
        # ack_wait the broker delivers it again. Acking here would lose the invoice for good.
        return
    except env.AccountClosed as err:
        # No retry can ever issue this invoice: hand it to people, then ack so it stops coming back.
        # Report first: a kill between the two lines then brings the request back to be reported,
        # instead of leaving it acked and unreported.
        env.reject(order_id, str(err))
        await msg.ack_sync()
        return
    # The invoice is out. A kill before the ack reaches the broker means a redelivery and a second
    # invoice: that is at-least-once's price, and the reason to ack right away.
    await msg.ack_sync()  # returns once the server has recorded the ack; msg.ack() only queues it
    env.settled(order_id)  # so the dashboard never counts a request the broker could still redeliver
