"""A correct worker written differently: each delivery handled in a task of its own, a class that
keeps the policy, a DLQ publish retried in place when the stream refuses it, and a redrive that
reads the DLQ with an unnamed consumer of its own.

Expect: pass
"""

import asyncio
import json


class Policy:
    delays = (0.1, 0.25, 0.5, 1.0)
    budget = 5

    @staticmethod
    def transient(error):
        if isinstance(error, ConnectionResetError | ConnectionError | TimeoutError):
            return True
        status = getattr(error, "status", 0)
        return status == 429 or 500 <= status <= 599


class Worker:
    def __init__(self, env):
        self.env = env
        self.tasks = set()

    async def run(self):
        sub = await self.env.js.pull_subscribe_bind(self.env.durable("email"), self.env.stream("EMAILS"))
        while True:
            try:
                msgs = await sub.fetch(batch=1, timeout=0.4)
            except TimeoutError:
                continue
            for msg in msgs:
                task = asyncio.create_task(self.handle(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def handle(self, msg):
        n = msg.metadata.num_delivered
        try:
            await self.env.send_email(json.loads(msg.data))
        except Exception as error:
            if Policy.transient(error) and n < Policy.budget:
                await msg.nak(delay=Policy.delays[n - 1])
            elif await self.bury(msg, error):
                await msg.term()
            return
        await msg.ack_sync()

    async def bury(self, msg, error):
        headers = dict(msg.headers or {})
        headers.update(
            {
                "Dlq-Reason": f"{type(error).__name__}: {error}",
                "Dlq-Deliveries": str(msg.metadata.num_delivered),
                "Dlq-Stream-Seq": str(msg.metadata.sequence.stream),
                "Nats-Msg-Id": f"email-{msg.metadata.sequence.stream}",
            }
        )
        for _ in range(5):
            try:
                await self.env.js.publish(self.env.subject("orders.email.dlq"), msg.data, headers=headers)
                return True
            except Exception:
                await asyncio.sleep(0.1)
        return False


async def email_worker(env) -> None:
    await Worker(env).run()


async def redrive(env, order_ids) -> int:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    # An unnamed consumer over the whole DLQ (the learner's user may create these, not named ones).
    info = await env.js.add_consumer(
        env.stream("EMAILS_DLQ"), ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
    )
    sub = await env.js.pull_subscribe_bind(info.name, env.stream("EMAILS_DLQ"))
    sent = 0
    try:
        while True:
            try:
                entries = await sub.fetch(10, timeout=0.3)
            except TimeoutError:
                break
            for entry in entries:
                headers = dict(entry.headers or {})
                if headers.get("Order-Id") in order_ids:
                    keep = {k: v for k, v in headers.items() if not k.startswith("Dlq-") and k != "Nats-Msg-Id"}
                    keep["Nats-Msg-Id"] = f"redrive-{entry.metadata.sequence.stream}"
                    await env.js.publish(env.subject("orders.email"), entry.data, headers=keep)
                    sent += 1
    finally:
        await sub.unsubscribe()
    return sent
