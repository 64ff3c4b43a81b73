"""Refuses by age, but accepts into an in-memory queue that a background task publishes.

SIGKILLed right after "accepted", the order dies with the process; while the stream is full it is
accepted and only stored later.
Expect: fail no_accepted_order_lost, busy_when_stream_full
"""


import asyncio
import json
import time

from nats.js.errors import APIError, NotFoundError

ACCEPTED, BUSY = "accepted", "busy"


async def queue_depth(env) -> int:
    """How many orders the durable has not seen acked: undelivered plus delivered-but-unacked."""
    info = await env.js.consumer_info(env.stream("ORDERS"), env.durable("fulfil"))
    return info.num_pending + info.num_ack_pending


async def queue_age(env) -> float:
    """Seconds the oldest order the fulfilment workers have not finished has waited; 0.0 when none waits."""
    info = await env.js.consumer_info(env.stream("ORDERS"), env.durable("fulfil"))
    try:
        oldest = await env.js.get_msg(
            env.stream("ORDERS"), info.ack_floor.stream_seq + 1, subject=env.subject("orders.placed"), next=True
        )
    except NotFoundError:
        return 0.0  # nothing after the ack floor: every order is done
    return max(0.0, time.time() - oldest.time.timestamp())


def queue_status(samples, budget) -> str:
    """OK, WARNING or ERROR from the monitor's recent samples (oldest first), by the rule in README.md."""
    first, newest = samples[0], samples[-1]
    if newest.age >= budget:
        return "ERROR"
    span = newest.t - first.t
    if len(samples) >= 2 and span > 0 and newest.age - first.age >= 0.5 * span:
        return "WARNING"
    return "OK"


async def place_order(env, order) -> str:
    """Answer at once; a background task publishes, retrying until the stream stores it."""
    if await queue_age(env) > env.age_budget:
        return BUSY
    if not hasattr(env, "outbox"):
        env.outbox = asyncio.Queue()
        env.publisher = asyncio.ensure_future(_publish_forever(env))
    env.outbox.put_nowait(order)
    return ACCEPTED


async def _publish_forever(env) -> None:
    while True:
        order = await env.outbox.get()
        while True:
            try:
                await env.js.publish(env.subject("orders.placed"), json.dumps(order).encode())
                break
            except APIError:
                await asyncio.sleep(0.05)
