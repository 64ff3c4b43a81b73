"""Also right: msg.ack() then nc.flush(), which returns once the server answered a PING sent after
the ack, so the ack is on the server before the dashboard hears of it; term() for the closed account.

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


class Heartbeat:
    """While the block runs, tell the broker every 0.15 s that msg is still being worked on."""

    def __init__(self, msg):
        self.msg = msg

    async def _beat(self):
        while True:
            await asyncio.sleep(0.15)
            await self.msg.in_progress()

    async def __aenter__(self):
        self.task = asyncio.create_task(self._beat())

    async def __aexit__(self, *exc):
        self.task.cancel()


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
                async with Heartbeat(msg):  # the invoice can take longer than ack_wait
                    await env.send_invoice(order_id)
            except env.ServiceUnavailable:
                continue
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                await msg.term()  # never deliver it again
                continue
            await msg.ack()
            await env.nc.flush()  # the ack is on the wire and read by the server
            env.settled(order_id)
