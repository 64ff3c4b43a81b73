"""Wrong variant: publishes the event, then waits for the email worker to confirm the email.

The order path waits for email again: while the worker is down every order fails (after its event was
already announced).
Expect: fail accepts_while_email_down, refused_never_announced
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
    # "Make sure the email went out" before answering the customer.
    confirmed = await env.nc.subscribe(env.subject(f"emails.sent.{order['id']}"), max_msgs=1)
    await env.js.publish(env.subject("orders.placed"), data)
    await confirmed.next_msg(timeout=1.0)


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
            await env.nc.publish(env.subject(f"emails.sent.{order['id']}"), b"sent")
