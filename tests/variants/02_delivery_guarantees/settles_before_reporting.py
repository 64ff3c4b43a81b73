"""Wrong variant: settles the closed account on the broker first ("so it never comes back"), then
reports it to the billing team. A kill between the two lines leaves a request the broker has
forgotten and nobody in billing has heard of.

Expect: fail refused_requests_reported
Says: report first, then settle
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


async def heartbeat(msg):
    while True:
        await asyncio.sleep(0.1)
        await msg.in_progress()


async def invoice_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.3)
        except TimeoutError:
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            beat = asyncio.create_task(heartbeat(msg))
            try:
                await env.send_invoice(order_id)
            except env.ServiceUnavailable:
                continue
            except env.AccountClosed as err:
                await msg.ack_sync()  # settled: it never comes back...
                env.reject(order_id, str(err))  # ...then billing hears of it
                continue
            finally:
                beat.cancel()
            await msg.ack_sync()
            env.settled(order_id)
