"""Lesson 04's own cells pasted into the lab's file, renamed to env.*: `transient` (section 2), the
last `dead_letter` with its Nats-Msg-Id and `with_dlq` (section 3), the redrive that removes what it
sent (section 5), its delays from 50 ms; plus the one `try` the README's item 4 spells out (a refused
dead letter leaves the email unsettled, so it comes back). The lesson never meets a refused dead
letter on the last delivery the budget allows, where no delivery is left to bring the email back;
nor does it wait the README's 0.1 s before a first retry. (Its delete_msg is denied in the lab.)

Expect: fail none_lost, retries_bounded
Says: the last the budget allows
"""

import json

from nats.js.errors import NotFoundError

FETCH_TIMEOUT = 0.3
DELAYS = [0.05, 0.1, 0.2, 0.4]  # before retry 1, 2, 3, 4


def transient(error):
    """Will the same request go through later? Judged from the error alone."""
    status = getattr(error, "status", None)
    return isinstance(error, ConnectionError) or status == 429 or (status or 0) >= 500


def is_transient(error) -> bool:
    return transient(error)


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=FETCH_TIMEOUT)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle(env, msg)


async def dead_letter(env, msg, error):
    headers = dict(msg.headers or {})
    headers["Dlq-Reason"] = f"{type(error).__name__}: {error}"
    headers["Dlq-Deliveries"] = str(msg.metadata.num_delivered)
    headers["Dlq-Stream-Seq"] = str(msg.metadata.sequence.stream)
    meta = msg.metadata  # the same on every delivery of this message
    headers["Nats-Msg-Id"] = f"dlq-{meta.stream}-{meta.consumer}-{meta.sequence.stream}"
    await env.js.publish(env.subject("orders.email.dlq"), msg.data, headers=headers)


async def with_dlq(env, msg):
    n = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception as error:
        if transient(error) and n < 5:
            await msg.nak(delay=DELAYS[n - 1])
            return
        await dead_letter(env, msg, error)
        await msg.term()  # only once the DLQ has it
        return
    await msg.ack_sync()


async def handle(env, msg) -> None:
    try:
        await with_dlq(env, msg)
    except Exception:
        return  # the DLQ refused it: it comes back after ack_wait (the lab's README says so)


async def redrive(env, order_ids, remove=True):
    seq = 1
    while True:
        try:
            entry = await env.js.get_msg(env.stream("EMAILS_DLQ"), seq, subject=env.subject("orders.email.dlq"), next=True)
        except NotFoundError:
            return
        seq = entry.seq + 1
        if entry.headers.get("Order-Id") in order_ids:
            headers = {k: v for k, v in entry.headers.items() if not k.startswith(("Dlq-", "Nats-"))}
            headers["Nats-Msg-Id"] = f"redrive-{entry.seq}"  # killed before the removal: the rerun is dropped
            await env.js.publish(env.subject("orders.email"), entry.data, headers=headers)
            if remove:
                await env.js.delete_msg(env.stream("EMAILS_DLQ"), entry.seq)  # handled: no later run sees it
