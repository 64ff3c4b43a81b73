"""Wrong variant: acks before asking for the invoice, after first invoicing the latest three orders of
the stream, read there, not taken from the durable: on a grader that counted every call
about a real order, those calls absorbed the planned kills while the worker held none of them. A planned
kill counts only calls about a request the server delivered to that worker, so it falls between an ack
and its invoice, and the calls about requests it was never given are named.

Expect: fail effects_on_the_workload
Says: the server never delivered
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


async def _latest_orders(env, count: int) -> list[str]:
    """The order ids of the stream's latest messages, read from the stream itself (no delivery)."""
    stream = env.stream("BILLING")
    while (last := (await env.js.stream_info(stream)).state.last_seq) < count:
        await asyncio.sleep(0.02)
    found = []
    for seq in range(last - count + 1, last + 1):
        found.append(json.loads((await env.js.get_msg(stream, seq)).data)["order_id"])
    return found


async def invoice_worker(env) -> None:
    for order_id in await _latest_orders(env, 3):  # real orders, never delivered to this worker
        try:
            await env.send_invoice(order_id)
        except (env.ServiceUnavailable, env.AccountClosed):
            pass
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
