"""Lab 02: an invoice worker that never loses an invoice.

Every order needs its invoice: a lost one is revenue nobody collects. Invoice requests wait on
a durable consumer; your worker takes them one by one, sends each invoice and acks. The grader
SIGKILLs the worker at the worst moments (before the invoice goes out, between the invoice and
the ack, right after the ack) and starts it again: nothing may be lost, and an invoice may go
out twice only where a crash fell between sending it and acking it.

What the grader (or the lab notebook) hands you in `env`:
  env.js                       a JetStream context (env.nc is its connection)
  env.stream("BILLING")        the stream of invoice requests (it exists already)
  env.durable("invoicer")      your durable consumer on it (it exists already; ack_wait 0.5 s)
  await env.send_invoice(oid)  sends the invoice for order oid; sometimes raises env.TransientError
                               (the invoicing service is busy: the same call succeeds later)
  env.settled(oid)             tells the billing dashboard the request is finished; call it
                               right after the broker has confirmed your ack, never before

Check your work:  msglab check 02   (or run the last cell of lab.ipynb)
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
            await msg.ack_sync()  # returns once the server has the ack, so settled below is true
            env.settled(order_id)
