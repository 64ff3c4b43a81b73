"""Wrong variant: Kafka-style commit: fetches a batch and acks only its last message, as if that ack
covered everything before it. JetStream's ack is per message: the others are never acked, come
back after ack_wait and are invoiced again, though no crash explains it.

Expect: fail duplicates_only_after_crash
Says: ack of their own
"""

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
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=0.5)
        except TimeoutError:
            continue
        sent = []
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            try:
                await env.send_invoice(order_id)
                sent.append(order_id)
            except env.ServiceUnavailable:
                pass
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
        await msgs[-1].ack_sync()  # "commits the batch"
        for order_id in sent:
            env.settled(order_id)
