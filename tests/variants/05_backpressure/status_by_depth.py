"""The age is right, but the status looks at the depth: alarm above 100 orders, fine below.

Expect: fail not_fooled_by_depth, status_from_level_and_trend
"""


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
    """Alarm on a deep queue, as the old dashboard did."""
    depth = samples[-1].depth
    if depth >= 100:
        return "ERROR"
    if depth >= 20:
        return "WARNING"
    return "OK"


async def place_order(env, order) -> str:
    """ACCEPTED once the stream has stored the order; BUSY when the shop cannot keep its promise now."""
    if await queue_age(env) > env.age_budget:
        return BUSY  # the oldest order already waits longer than we promise: say so now
    try:
        await env.js.publish(env.subject("orders.placed"), json.dumps(order).encode())
    except APIError as exc:
        if exc.err_code == 10077:  # the stream is full (discard-new): busy, try later
            return BUSY
        raise
    return ACCEPTED
