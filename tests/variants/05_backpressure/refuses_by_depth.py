"""The monitor is right, but the intake refuses by depth: busy above 100 waiting orders.

A fixed depth limit assumes a drain rate: at one slow worker's pace, 100 orders are seconds of
waiting, so the orders it accepts in the rush break the promise (and it accepts while the age is
over the budget). Depth becomes a wait only divided by the rate the workers really finish orders.
Expect: fail promise_kept
Says: depth / drain rate
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
    """OK, WARNING or ERROR from the monitor's recent samples (oldest first), by the rule in README.md."""
    first, newest = samples[0], samples[-1]
    if newest.age >= budget:
        return "ERROR"
    span = newest.t - first.t
    if len(samples) >= 2 and span > 0 and newest.age - first.age >= 0.5 * span:
        return "WARNING"
    return "OK"


async def place_order(env, order) -> str:
    """Busy when too many orders wait."""
    if await queue_depth(env) > 100:
        return BUSY
    try:
        await env.js.publish(env.subject("orders.placed"), json.dumps(order).encode())
    except APIError as exc:
        if exc.err_code == 10077:
            return BUSY
        raise
    return ACCEPTED
