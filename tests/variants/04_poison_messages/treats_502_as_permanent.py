"""Retries a fixed list of statuses that leaves 502 out: a Bad Gateway from the recipient's mail
server that would pass a moment later is dead-lettered at once.

Expect: fail transient_delivered
Says: 502 Bad Gateway
"""

import asyncio
import json

FETCH_TIMEOUT = 0.3  # seconds a fetch waits for email (scaled down: production long-polls 5-30 s)
RETRYABLE = {429, 500, 503, 504}  # "the provider is busy or down"; 502 left out, as if it blamed the request
BUDGET = 5  # deliveries in all, as the durable allows (its max_deliver)
RETRY_DELAYS = [0.1, 0.2, 0.4, 0.8]  # before retry 1, 2, 3, 4: doubling, 1.5 s in all (production: 1, 10, 100, 1000 s)
DLQ_RETRY = 0.05  # the first wait before a refused dead letter is published again on the last delivery


def is_transient(error) -> bool:
    """Will the same request go through later? Judged from the error alone."""
    # A dropped connection, a 5xx (the provider or the recipient's server is in trouble) or a 429 (we were too
    # fast) pass with time. Any other 4xx says the request itself is wrong, and so does a payload we cannot
    # parse: sent again, it fails again.
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    status = getattr(error, "status", None)
    return status in RETRYABLE


async def email_worker(env) -> None:
    """Send every email on the durable, forever (the grader kills and replaces this process)."""
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=FETCH_TIMEOUT)
        except TimeoutError:
            continue  # nothing to do yet: a worker keeps asking
        for msg in msgs:
            await handle(env, msg)


async def handle(env, msg) -> None:
    """One delivery: sent and acked, left to come back later, or dead-lettered."""
    delivery = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception as error:
        # The broker keeps the email for the delay and hands it back; meanwhile this worker takes the next one.
        # Never sleep here: a sleeping handler holds up every email behind this one.
        if is_transient(error) and delivery < BUDGET:
            await msg.nak(delay=RETRY_DELAYS[min(delivery, len(RETRY_DELAYS)) - 1])
            return
        try:
            await dead_letter(env, msg, error)
        except Exception:
            if delivery < BUDGET:
                # The DLQ did not take it: leave the email unsettled, so it comes back (after ack_wait) and is
                # dead-lettered then. Terming it now would lose it.
                return
            # The last delivery: nothing brings it back (the server stops at max_deliver), so keep it here.
            await keep_until_dead_lettered(env, msg, error)
        await msg.term()  # dead-lettered: never deliver it again
        return
    await msg.ack_sync()


async def keep_until_dead_lettered(env, msg, error) -> None:
    """Publish the dead letter again until the DLQ stream has it, keeping this worker's claim on the email."""
    wait = DLQ_RETRY
    while True:
        await msg.in_progress()  # resets ack_wait: the email stays ours while the DLQ is refusing
        await asyncio.sleep(wait)  # a rare wait, on an email no other delivery can save
        try:
            await dead_letter(env, msg, error)
            return
        except Exception:
            wait = min(wait * 2, 0.4)


async def dead_letter(env, msg, error) -> None:
    """Publish the failed email to the DLQ: its own bytes and headers, plus what went wrong and when."""
    headers = dict(msg.headers or {})
    headers.update(
        {
            "Dlq-Reason": f"{type(error).__name__}: {error}",
            "Dlq-Deliveries": str(msg.metadata.num_delivered),
            "Dlq-Stream-Seq": str(msg.metadata.sequence.stream),
            # A kill after this publish and before the term brings the email back, and it is dead-lettered again.
            # The id names the email message itself, the same on every delivery: the DLQ stream drops the copy.
            "Nats-Msg-Id": f"dlq-{msg.metadata.sequence.stream}",
        }
    )
    await env.js.publish(env.subject("orders.email.dlq"), msg.data, headers=headers)


async def redrive(env, order_ids) -> int:
    """Send the dead-lettered emails of these orders again (their cause is fixed); return how many were republished."""
    wanted = set(order_ids)
    dlq = env.stream("EMAILS_DLQ")
    last = (await env.js.stream_info(dlq)).state.last_seq
    republished = 0
    for seq in range(1, last + 1):
        entry = await env.js.get_msg(dlq, seq)
        headers = dict(entry.headers or {})
        if headers.get("Order-Id") not in wanted:
            continue
        original = {k: v for k, v in headers.items() if not k.startswith("Dlq-") and k != "Nats-Msg-Id"}
        # The id names this DLQ entry: a second run (or a run after a crash halfway) publishes the same id,
        # and the EMAILS stream drops it instead of storing a second copy (within its 2-minute window).
        original["Nats-Msg-Id"] = f"redrive-{seq}"
        ack = await env.js.publish(env.subject("orders.email"), entry.data, headers=original)
        republished += not ack.duplicate
    return republished
