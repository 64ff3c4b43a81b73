"""A correct worker written differently: it keeps the last delivery in reserve. A transient failure
is retried on deliveries 1-3 and given up on at delivery 4, so a refused dead letter still has a
delivery left to come back on; a dead letter refused there is nak'ed with a delay. Errors judged
by a table of statuses, delays from a dict, a match statement, a redrive reading the DLQ by
subject with `next`.

Expect: pass
"""

import json

from nats.js.errors import NotFoundError

GIVE_UP_AT = 4  # the 5th and last delivery is the spare: a refused dead letter comes back on it
WAITS = {1: 0.12, 2: 0.25, 3: 0.5, 4: 0.5}  # seconds before the next delivery
PERMANENT_4XX = range(400, 500)


def is_transient(error) -> bool:
    match error:
        case ConnectionResetError() | ConnectionError():
            return True
        case _ if isinstance(getattr(error, "status", None), int):
            return error.status == 429 or error.status not in PERMANENT_4XX
        case _:
            return False


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.3)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle(env, msg)


async def handle(env, msg) -> None:
    n = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception as error:
        if is_transient(error) and n < GIVE_UP_AT:
            await msg.nak(delay=WAITS[n])
            return
        try:
            await dead_letter(env, msg, error)
        except Exception:
            await msg.nak(delay=WAITS.get(n, 0.5))  # the spare delivery brings it back
            return
        await msg.term()
        return
    await msg.ack_sync()


async def dead_letter(env, msg, error) -> None:
    meta = msg.metadata
    headers = {
        **(msg.headers or {}),
        "Dlq-Reason": f"{error.__class__.__name__}: {error}",
        "Dlq-Deliveries": str(meta.num_delivered),
        "Dlq-Stream-Seq": str(meta.sequence.stream),
        "Nats-Msg-Id": f"{meta.stream}:{meta.sequence.stream}:dead",
    }
    await env.js.publish(env.subject("orders.email.dlq"), msg.data, headers=headers)


async def redrive(env, order_ids) -> int:
    count, seq = 0, 1
    dlq, subject = env.stream("EMAILS_DLQ"), env.subject("orders.email.dlq")
    while True:
        try:
            entry = await env.js.get_msg(dlq, seq, subject=subject, next=True)
        except NotFoundError:
            return count
        seq = entry.seq + 1
        headers = dict(entry.headers or {})
        if headers.get("Order-Id") not in order_ids:
            continue
        keep = {k: v for k, v in headers.items() if not k.startswith(("Dlq-", "Nats-"))}
        keep["Nats-Msg-Id"] = f"again:{dlq}:{entry.seq}"
        ack = await env.js.publish(env.subject("orders.email"), entry.data, headers=keep)
        count += not ack.duplicate
