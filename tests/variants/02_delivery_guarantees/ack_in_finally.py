"""Wrong variant: acks in `finally`, whatever happened, "so nothing clogs the queue". A request the
service could not take for the moment is acked without its invoice, and lost.

Expect: fail no_lost_invoices
"""

import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"

GUARANTEES = {
    "core_subscriber": AT_MOST_ONCE,
    "ack_then_work": AT_MOST_ONCE,
    "work_then_ack": AT_LEAST_ONCE,
    "ack_in_finally": NEITHER,
    "dedup_then_ack": EFFECTIVELY_ONCE,
}


async def invoice_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            sent = False
            try:
                await env.send_invoice(order_id)
                sent = True
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
            except env.ServiceUnavailable:
                print(f"{order_id}: service unavailable, will retry")  # ...but finally acks it
            finally:
                await msg.ack_sync()
            if sent:
                env.settled(order_id)
