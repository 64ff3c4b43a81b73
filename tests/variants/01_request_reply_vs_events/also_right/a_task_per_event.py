"""Correct, written differently: each event is handled in a task of its own while the loop fetches on.

Every task emails its event and then acks it (confirmed by the server); a refused email is nak'ed. The
loop keeps a reference to its tasks and never waits for them before asking for more.
Expect: pass
"""

import asyncio
import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed: the inventory did not answer within env.request_timeout, or nobody listens."""


async def place_order(env, order: dict) -> None:
    """Accept one order by returning, or refuse it by raising; the customer sees the outcome at once."""
    data = json.dumps(order).encode()
    # A question: whether the order is possible decides what we tell the customer, so we ask and
    # wait, but only as long as the inventory is allowed to take. Both ways of getting no answer
    # mean the same to the customer: stock could not be confirmed, so the order is refused now.
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except nats.errors.NoRespondersError as exc:  # nobody listens: the server says so at once
        raise InventoryUnavailable(f"nobody answers for inventory: {order['id']} not accepted") from exc
    except nats.errors.TimeoutError as exc:  # the request arrived and no answer came in time
        raise InventoryUnavailable(f"no answer within {env.request_timeout} s: {order['id']} not accepted") from exc
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    # A fact: email and loyalty merely react to it, each from its own durable on this one subject,
    # so neither is called here, and neither being down can fail or slow this order. Announced
    # last, once nothing can refuse the order any more. js.publish returns once the stream has
    # stored the event (its PubAck) and raises when the stream refuses it: "accepted" is a promise
    # the stream has made. (If it raises, the order was saved but never announced; lesson 07's
    # transactional outbox closes that gap.)
    await env.js.publish(env.subject("orders.placed"), data)


async def handle(env, msg) -> None:
    try:
        env.send_email(json.loads(msg.data)["id"])
    except ConnectionError:
        await msg.nak()
        return
    await msg.ack_sync()


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    running: set[asyncio.Task] = set()
    while True:
        try:
            msgs = await sub.fetch(batch=3, timeout=0.3)
        except TimeoutError:
            continue
        for msg in msgs:
            task = asyncio.create_task(handle(env, msg))
            running.add(task)
            task.add_done_callback(running.discard)
