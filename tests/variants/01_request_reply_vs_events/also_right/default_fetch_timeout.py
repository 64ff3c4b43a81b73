"""Correct, written differently: fetch with nats-py's default timeout (5 s), and a for-else loop.

New events arrive during the wait at once; the grader just has to wait longer to see the worker survive
an empty fetch.
Expect: pass
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
    await env.js.publish(env.subject("orders.placed"), data)


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            msgs = await sub.fetch(10)
        except asyncio.TimeoutError:
            msgs = []
        for msg in msgs:
            order = json.loads(msg.data)
            for attempt in range(4):  # the provider may be back in a moment: try again, a little later each time
                try:
                    env.send_email(order["id"])
                    break
                except ConnectionError:
                    await asyncio.sleep(0.05 * 2**attempt)
            else:
                continue  # still down: leave it unacked, the broker delivers it again
            await msg.ack_sync()
