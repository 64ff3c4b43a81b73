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

import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"  # can lose a message, and can also process one twice

# Which guarantee does each worker in workers.py give the invoice? One of the four names above.
GUARANTEES = {
    # TODO: Replace each None with the guarantee that worker gives: AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE or NEITHER.
    "core_subscriber": None,
    "ack_then_work": None,
    "work_then_ack": None,
    "ack_in_finally": None,
    "dedup_then_ack": None,
}


async def invoice_worker(env) -> None:
    """Invoice every request on the durable, forever (the grader kills and restarts this process)."""
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.25)
        except TimeoutError:  # nothing to do yet: ask again
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            # TODO: No invoice may be lost, whichever line the process is killed on.
            # TODO: The billing dashboard must never count a request the broker could still redeliver.
            # TODO: When the invoicing service fails, read its error: a request it can take later must come back until it is invoiced.
            # TODO: While the service is restarting, give a request it cannot take now time before its next try: no hot loop.
            # TODO: A request it will never take must be reported to the billing team, and must then stop coming back.
            # TODO: An invoice can take longer than the redelivery timer: while yours waits for one, no other worker may be handed the request.
            await msg.ack()  # ack first, so a slow invoice is never delivered twice
            await env.send_invoice(order_id)
            env.settled(order_id)
