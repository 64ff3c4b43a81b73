"""Also right, shaped differently: a request the service cannot take now is retried inside the
handler, a pause between tries, while the worker tells the broker it is still on it (so the
request is not delivered again meanwhile), also while a call is running (polled with
asyncio.wait); after a few tries it is nak'ed with a delay. The closed account is reported, then
terminated.

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

PAUSE = 0.15  # between two tries of one request
TRIES = 4  # in the handler, before the request goes back to the broker


async def watched(msg, call):
    """Await call; each time 0.15 s pass without an answer, tell the broker msg is still in progress."""
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.15)
        if done:
            return task.result()  # raises what the call raised
        await msg.in_progress()


async def try_invoice(env, msg, order_id) -> bool:
    """True once the invoice went out; False if the service still says 'not now' after TRIES tries."""
    for attempt in range(TRIES):
        try:
            await watched(msg, env.send_invoice(order_id))
            return True
        except env.ServiceUnavailable:
            if attempt + 1 < TRIES:
                await asyncio.sleep(PAUSE)
                await msg.in_progress()  # still mine: restart the redelivery timer
    return False


async def invoice_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.4)
        except TimeoutError:
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            try:
                sent = await try_invoice(env, msg, order_id)
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                await msg.term()
                continue
            if not sent:
                await msg.nak(delay=0.2)
                continue
            await msg.ack_sync()
            env.settled(order_id)
