"""Publishes dead letters without a Nats-Msg-Id, after first dead-lettering two orders nobody placed:
on a grader that counted every call, those decoy dead letters took the DLQ's planned refusal and the
planned kill while the worker held no email. A planned fault lands on the workload, so a kill after
the publish and before the term leaves a second copy, and the decoys are named.

Expect: fail effects_on_the_workload, dlq_once
Says: no message of this run carries
"""

import contextlib
import json

BUDGET = 5
RETRY_DELAYS = [0.1, 0.2, 0.4, 0.8]


def is_transient(error) -> bool:
    if isinstance(error, ConnectionError):
        return True
    status = getattr(error, "status", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


async def email_worker(env) -> None:
    for n in range(2):  # the decoys: dead letters about orders nobody placed
        with contextlib.suppress(Exception):  # the DLQ stream may refuse them
            await env.js.publish(env.subject("orders.email.dlq"), b"{}", headers={"Order-Id": f"no-such-{n}"})
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle(env, msg)


async def handle(env, msg) -> None:
    delivery = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception as error:
        if is_transient(error) and delivery < BUDGET:
            await msg.nak(delay=RETRY_DELAYS[delivery - 1])
            return
        try:
            await dead_letter(env, msg, error)
        except Exception:
            return
        await msg.term()
        return
    await msg.ack_sync()


async def dead_letter(env, msg, error) -> None:
    headers = dict(msg.headers or {})
    headers["Dlq-Reason"] = f"{type(error).__name__}: {error}"
    headers["Dlq-Deliveries"] = str(msg.metadata.num_delivered)
    headers["Dlq-Stream-Seq"] = str(msg.metadata.sequence.stream)
    await env.js.publish(env.subject("orders.email.dlq"), msg.data, headers=headers)


async def redrive(env, order_ids) -> int:
    dlq = env.stream("EMAILS_DLQ")
    last = (await env.js.stream_info(dlq)).state.last_seq
    count = 0
    for seq in range(1, last + 1):
        entry = await env.js.get_msg(dlq, seq)
        headers = dict(entry.headers or {})
        if headers.get("Order-Id") not in order_ids:
            continue
        original = {k: v for k, v in headers.items() if not k.startswith("Dlq-") and k != "Nats-Msg-Id"}
        original["Nats-Msg-Id"] = f"redrive-{seq}"
        await env.js.publish(env.subject("orders.email"), entry.data, headers=original)
        count += 1
    return count
