"""Wrong variant: treats every failure of the invoicing service as temporary and lets the request
come back; the one whose customer closed their account comes back forever and is never reported.

Expect: fail refused_requests_reported, all_acked
Says: AccountClosed
Says: never reported
Says: env.reject
Says: can never be invoiced
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


async def beating(msg, call):
    """Await call while a side task tells the broker msg is still in progress (the invoice can outlast ack_wait)."""
    task = asyncio.create_task(_beat(msg))
    try:
        return await call
    finally:
        task.cancel()


async def _beat(msg):
    while True:
        await asyncio.sleep(0.1)
        await msg.in_progress()


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
                await beating(msg, env.send_invoice(order_id))
            except env.InvoicingError:
                continue  # no ack: it comes back after ack_wait, and maybe then it works
            await msg.ack_sync()
            env.settled(order_id)
