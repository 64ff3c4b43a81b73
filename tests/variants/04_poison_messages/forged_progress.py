"""Retries inside the handler, sleeping out each wait, and while it sleeps publishes an in-progress for
every stream sequence on `$JS.ACK...` subjects it builds itself: forged signs of a worker touching the
emails stuck behind it. The server acted on no delivery of them, so they are no evidence: every email
behind the failing one still waits.

Expect: fail line_keeps_moving
Says: within one delivery
"""

import json

BUDGET = 5
RETRY_DELAYS = [0.1, 0.2, 0.4, 0.8]


def is_transient(error) -> bool:
    if isinstance(error, ConnectionError):
        return True
    status = getattr(error, "status", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


async def forge_progress(env) -> None:
    stream, durable = env.stream("EMAILS"), env.durable("email")
    for seq in range(1, 65):
        await env.nc.publish(f"$JS.ACK.{stream}.{durable}.1.{seq}.{seq}.0.0", b"+WPI")


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            await handle(env, msg)


async def handle(env, msg) -> None:
    import asyncio

    try:
        email = json.loads(msg.data)
    except ValueError as error:
        try:
            await dead_letter(env, msg, error)
        except Exception:
            return
        await msg.term()
        return
    for attempt in range(BUDGET):
        try:
            await env.send_email(email)
        except Exception as error:
            if is_transient(error) and attempt < BUDGET - 1:
                await forge_progress(env)
                await asyncio.sleep(RETRY_DELAYS[attempt])
                continue
            try:
                await dead_letter(env, msg, error)
            except Exception:
                return
            await msg.term()
            return
        await msg.ack_sync()
        return


async def dead_letter(env, msg, error) -> None:
    headers = dict(msg.headers or {})
    headers["Dlq-Reason"] = f"{type(error).__name__}: {error}"
    headers["Dlq-Deliveries"] = str(msg.metadata.num_delivered)
    headers["Dlq-Stream-Seq"] = str(msg.metadata.sequence.stream)
    headers["Nats-Msg-Id"] = f"dlq-{msg.metadata.sequence.stream}"
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
