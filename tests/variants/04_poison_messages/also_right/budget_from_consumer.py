"""A correct worker written differently: the budget read from the durable, delays from a formula,
a set of retryable statuses, a dead letter refused on the last delivery published again every
0.1 s until the DLQ has it, and a redrive that names each republish after the original message.

Expect: pass
"""

import asyncio
import json

RETRYABLE = {429, 500, 502, 503, 504}


def backoff(delivery: int) -> float:
    return 0.15 * 2 ** (delivery - 1)  # 0.15, 0.3, 0.6, 1.2 s


def retryable(error: Exception) -> bool:
    return isinstance(error, ConnectionError) or getattr(error, "status", None) in RETRYABLE


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    budget = (await sub.consumer_info()).config.max_deliver
    while True:
        try:
            batch = await sub.fetch(1, timeout=0.3)
        except TimeoutError:
            continue
        for msg in batch:
            meta = msg.metadata
            try:
                email = json.loads(msg.data)
                await env.send_email(email)
            except Exception as error:
                if retryable(error) and meta.num_delivered < budget:
                    await msg.nak(delay=backoff(meta.num_delivered))
                    continue
                headers = {
                    **(msg.headers or {}),
                    "Dlq-Reason": repr(error),
                    "Dlq-Deliveries": f"{meta.num_delivered}",
                    "Dlq-Stream-Seq": f"{meta.sequence.stream}",
                    "Nats-Msg-Id": f"dead:{meta.stream}:{meta.sequence.stream}",
                }
                if not await publish_dead(env, msg, headers, last=meta.num_delivered >= budget):
                    await msg.nak(delay=0.2)  # the DLQ did not take it: try again soon
                    continue
                await msg.term()
            else:
                await msg.ack_sync()


async def publish_dead(env, msg, headers, last: bool) -> bool:
    """True once the DLQ stream has the dead letter; on the last delivery, keep trying (no delivery follows)."""
    while True:
        try:
            await env.js.publish(env.subject("orders.email.dlq"), msg.data, headers=headers)
            return True
        except Exception:
            if not last:
                return False
        await msg.in_progress()
        await asyncio.sleep(0.1)


async def redrive(env, order_ids) -> int:
    stream = env.stream("EMAILS_DLQ")
    info = await env.js.stream_info(stream)
    done = 0
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        dead = await env.js.get_msg(stream, seq)
        headers = dict(dead.headers or {})
        if headers.get("Order-Id") in order_ids:
            again = {k: v for k, v in headers.items() if k in ("Order-Id", "Correlation-Id")}
            again["Nats-Msg-Id"] = f"redriven:{headers['Dlq-Stream-Seq']}"
            ack = await env.js.publish(env.subject("orders.email"), dead.data, headers=again)
            done += 0 if ack.duplicate else 1
    return done
