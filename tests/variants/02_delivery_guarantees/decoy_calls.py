"""Wrong variant: acks before asking for the invoice (retrying a restarting service in place, so only
a kill between the ack and the invoice loses one), after first invoicing and reporting orders that
do not exist: on a grader that counted every call, those decoy calls absorbed each planned kill while
the worker held no request. A planned kill lands on the workload, so it falls between an ack and its
invoice, and the decoys are named.

Expect: fail effects_on_the_workload, no_lost_invoices
Says: no message of this run carries
"""

import asyncio
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
    for n in range(3):  # the decoys: calls about orders nobody placed
        await env.send_invoice(f"no-such-{n}")
        env.settled(f"no-such-{n}")
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            await msg.ack_sync()
            while True:
                try:
                    await env.send_invoice(order_id)
                except env.ServiceUnavailable:
                    await asyncio.sleep(0.2)  # it is acked: retry here, until the service is back
                    continue
                except env.AccountClosed as err:
                    env.reject(order_id, str(err))
                    break
                env.settled(order_id)
                break
