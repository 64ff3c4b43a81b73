"""Wrong variant: the event is published in the background and place_order returns at once.

The order is reported accepted before the stream has stored anything; when the stream refuses, it is lost.
Expect: fail accepted_means_stored
"""

import asyncio
import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed in time, or nobody listens."""


async def place_order(env, order: dict) -> None:
    data = json.dumps(order).encode()
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise InventoryUnavailable(f"no stock answer for {order['id']}") from exc
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    asyncio.ensure_future(env.js.publish(env.subject("orders.placed"), data))  # do not make the customer wait


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order = json.loads(msg.data)
            try:
                env.send_email(order["id"])
            except ConnectionError:  # the provider is down (not this variant's mistake): it comes back
                continue
            await msg.ack_sync()
