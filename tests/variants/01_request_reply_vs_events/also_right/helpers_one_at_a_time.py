"""Correct, written differently: helper functions, one event per fetch, the durable bound by name.

Expect: pass
"""

import asyncio
import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed in time, or nobody listens."""


async def reserve_stock(env, order: dict, data: bytes) -> None:
    """The one question of the order path; every way of not hearing back means the same to the customer."""
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except nats.errors.Error as exc:
        raise InventoryUnavailable(str(exc)) from exc
    answer = json.loads(reply.data)
    if answer.get("reserved") is not True:
        raise OutOfStock(order["id"])


async def announce(env, data: bytes) -> int:
    ack = await env.js.publish(env.subject("orders.placed"), data, stream=env.stream("ORDERS"))
    return ack.seq


async def place_order(env, order: dict) -> None:
    data = json.dumps(order).encode()
    await reserve_stock(env, order, data)
    env.save_order(order)
    await announce(env, data)


async def handle(env, msg) -> None:
    """Email one event, then ack it; if the provider refuses, nak it and let the broker bring it back."""
    try:
        env.send_email(json.loads(msg.data)["id"])
    except ConnectionError:
        await msg.nak()
        return
    await msg.ack_sync()


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe(env.subject("orders.placed"), durable=env.durable("email"), stream=env.stream("ORDERS"))
    while True:
        try:
            (msg,) = await sub.fetch(1, timeout=0.25)
        except nats.errors.TimeoutError:
            continue
        await handle(env, msg)
