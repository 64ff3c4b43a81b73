"""Also right, shaped differently: a class with helpers, an async generator that yields requests
forever, a table from error class to what to do with the request, and a heartbeat that an
asyncio.Event stops.

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


RETRY, GIVE_UP = "retry", "give up"


class Invoicer:
    def __init__(self, env):
        self.env = env
        self.on_error = {env.ServiceUnavailable: RETRY, env.AccountClosed: GIVE_UP}

    async def requests(self):
        sub = await self.env.js.pull_subscribe_bind(self.env.durable("invoicer"), self.env.stream("BILLING"))
        while True:
            try:
                batch = await sub.fetch(batch=3, timeout=0.2)  # a batch waits this long for more: well under ack_wait
            except TimeoutError:
                continue
            for msg in batch:
                yield json.loads(msg.data)["order_id"], msg

    def decide(self, err):
        return next((what for cls, what in self.on_error.items() if isinstance(err, cls)), RETRY)

    @staticmethod
    async def claimed(msg, call):
        """Run call; until it ends, the broker hears every 0.1 s that msg is still being worked on."""
        done = asyncio.Event()

        async def heartbeat():
            # The claim's clock started when the broker delivered msg, which may have waited in a batch
            # fetch for a while: the first sign goes out at once.
            while not done.is_set():
                await msg.in_progress()
                try:
                    await asyncio.wait_for(done.wait(), 0.1)
                except TimeoutError:
                    pass

        beats = asyncio.create_task(heartbeat())
        try:
            return await call
        finally:
            done.set()
            await beats

    async def invoice(self, order_id, msg):
        try:
            await self.claimed(msg, self.env.send_invoice(order_id))
        except self.env.InvoicingError as err:
            if self.decide(err) == GIVE_UP:
                self.env.reject(order_id, f"{type(err).__name__}: {err}")
                await msg.ack_sync()
            return
        await msg.ack_sync()
        self.env.settled(order_id)


async def invoice_worker(env) -> None:
    worker = Invoicer(env)
    async for order_id, msg in worker.requests():
        await worker.invoice(order_id, msg)
