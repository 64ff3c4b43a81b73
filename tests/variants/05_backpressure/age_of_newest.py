"""The age of the newest order (the last message on orders.placed).

While orders keep coming the newest is always young, so a stalled queue never looks old.
Expect: fail age_tracks_truth, refuses_over_budget
Says: the newest order's
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
    """How long ago the last order arrived."""
    try:
        newest = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
    except NotFoundError:
        return 0.0
    if await queue_depth(env) == 0:
        return 0.0
    return max(0.0, time.time() - newest.time.timestamp())


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
