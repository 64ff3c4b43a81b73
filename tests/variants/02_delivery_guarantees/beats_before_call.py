"""Wrong variant: the lesson's heartbeat, placed where this worker has steps of its own: it tells
the broker the request is in progress before the call and again after it. While the one long
call runs, nothing goes out, and the invoice that takes longer than ack_wait loses its claim.

Expect: fail keeps_claim
Says: another worker of the group
Says: from alongside the call
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
            await msg.in_progress()  # "still on it" before the long call...
            try:
                await env.send_invoice(order_id)
            except env.ServiceUnavailable:
                await msg.nak(delay=0.2)
                continue
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                await msg.term()
                continue
            await msg.in_progress()  # ...and after it
            await msg.ack_sync()
            env.settled(order_id)
