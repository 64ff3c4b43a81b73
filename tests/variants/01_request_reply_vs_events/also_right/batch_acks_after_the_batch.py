"""Correct, written differently: a larger batch, emailed first, then acked together.

A worker killed in the middle of a batch held the rest of it unacked: those emails may go out twice,
which the grader allows exactly there.
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
            batch = await sub.fetch(batch=50, timeout=0.3)
        except TimeoutError:
            continue
        sent = []
        for msg in batch:
            try:
                env.send_email(json.loads(msg.data)["id"])
            except ConnectionError:
                continue  # the provider is down: this one stays unacked and comes back
            sent.append(msg)
        for msg in sent:  # every email that went out: now the acks
            await msg.ack_sync()
