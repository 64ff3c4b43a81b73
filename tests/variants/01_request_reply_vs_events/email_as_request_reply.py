"""Wrong variant: loyalty is announced as an event, but email stays request-reply.

The email worker answers requests on email.send; while it is down nobody can order (temporal coupling).
Expect: fail accepts_while_email_down
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
    await env.nc.request(env.subject("email.send"), data, timeout=env.request_timeout)
    await env.js.publish(env.subject("orders.placed"), data)


async def email_worker(env) -> None:
    sub = await env.nc.subscribe(env.subject("email.send"))
    async for msg in sub.messages:
        try:
            env.send_email(json.loads(msg.data)["id"])
        except ConnectionError:  # the provider is down (not this variant's mistake): it comes back
            continue
        await msg.respond(b"sent")
