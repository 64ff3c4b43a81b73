"""Also right: fetches ten at a time, sends every invoice of the batch first, then acks each request
it finished (with ack_sync), then reports them. A kill in the middle of the batch brings back
every request that was sent but not acked: more duplicates than one at a time, each explained.
One heartbeat task keeps the whole batch claimed while its invoices go out.

Expect: pass
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


async def hold(msgs):
    """Every 0.1 s, tell the broker each message of the batch is still being worked on (until cancelled)."""
    while True:  # at once first: the batch may have waited in the fetch since its first delivery
        for msg in msgs:
            await msg.in_progress()
        await asyncio.sleep(0.1)


async def invoice_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=0.2)  # a batch waits this long for more: well under ack_wait
        except TimeoutError:
            continue
        done, reported = [], []
        holding = asyncio.create_task(hold(msgs))  # one heartbeat for the whole batch while it is invoiced
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            try:
                await env.send_invoice(order_id)
            except env.ServiceUnavailable:
                continue  # not acked: it comes back
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                done.append(msg)
                continue
            done.append(msg)
            reported.append(order_id)
        holding.cancel()
        for msg in done:
            await msg.ack_sync()
        for order_id in reported:
            env.settled(order_id)
