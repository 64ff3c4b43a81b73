"""Wrong variant: acks after the invoice with msg.ack(), which only buffers the ack; a crash
right after it (in env.settled) takes the ack with it and the invoice goes out twice.
"""


import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"  # can lose a message, and can also process one twice

# Which guarantee does each worker in workers.py give the invoice? One of the four names above.
GUARANTEES = {
    # TODO: Replace each None with what that worker gives: AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE or NEITHER.
    "core_subscriber": AT_MOST_ONCE,
    "ack_then_work": AT_MOST_ONCE,
    "work_then_ack": AT_LEAST_ONCE,
    "ack_in_finally": NEITHER,
    "dedup_then_ack": EFFECTIVELY_ONCE,
}


async def invoice_worker(env) -> None:
    """Invoice every request on the durable, forever (the grader kills and restarts this process)."""
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=1)
        except TimeoutError:  # nothing to do yet: ask again
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            # TODO: Send the invoice first and ack after it, with ack_sync so the server has the ack before env.settled.
            # TODO: When send_invoice raises env.TransientError, nak the message so it comes back, and skip the rest.
            try:
                await env.send_invoice(order_id)
            except env.TransientError:
                await msg.nak()  # redelivered at once; the busy service will most likely take it then
                continue
            await msg.ack()  # only queued in the client: not on the server yet
            env.settled(order_id)
