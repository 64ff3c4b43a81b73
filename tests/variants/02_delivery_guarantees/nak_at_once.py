"""Wrong variant: a request the service cannot take now is nak'ed without a delay, so it comes back
at once and is tried again, many times a second, while the service is restarting: a hot loop
that keeps a restarting service busy answering 'not now'.

Expect: fail retries_spaced
Says: hot loop
Says: instead of one right away
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
            try:
                await env.send_invoice(order_id)
            except env.ServiceUnavailable:
                await msg.nak()
                continue
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                await msg.ack_sync()
                continue
            await msg.ack_sync()
            env.settled(order_id)
