"""The age estimated from the depth: depth / an assumed drain rate of 100 orders a second.

The deep import (hundreds of orders, a moment old) looks seconds old, the stuck order looks new.
Expect: fail age_tracks_truth, not_fooled_by_depth
Says: a count is not a time
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
    """How long the queue would take to drain at the usual 100 orders a second."""
    return await queue_depth(env) / 100.0


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
