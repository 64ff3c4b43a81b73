"""Wrong variant: the lab's worker as it would be without the big invoice in mind: it invoices, acks
and reports in the right order, tells the two refusals apart, but sends the broker no sign of
life while a call runs. The invoice that takes longer than ack_wait is handed to another worker
of the group while this one still waits for it.

Expect: fail keeps_claim
Says: no sign that it was still on it
Says: another worker of the group
"""

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


async def handle(env, msg) -> None:
    order_id = json.loads(msg.data)["order_id"]
    try:
        await env.send_invoice(order_id)
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
