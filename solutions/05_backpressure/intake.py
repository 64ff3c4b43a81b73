"""Lab 05: know how long the oldest order has waited, and say "busy" before the promise breaks.

The fulfilment workers take orders from the durable `fulfil` at their own pace, and nothing
pushes back on the checkout: in a burst, or while a worker is stuck, the queue grows and every
customer is still told "accepted", whatever the wait. Today the monitor watches the queue's
depth, which says little about the wait, and the intake accepts everything, keeping orders in
memory to answer fast. The task, as requirements, is in README.md.

What the grader (or the lab notebook) hands you in `env`:
  env.js                          a JetStream context on a live connection
  env.stream("ORDERS")            the stream: it stores "orders.>", so also "orders.cancelled"
  env.durable("fulfil")           the fulfilment workers' durable; it delivers "orders.placed" only
  env.subject("orders.placed")    where an accepted order goes, as JSON with its "id"
  env.age_budget                  seconds: the longest an order may wait until a worker has acked it (the promise)
  env.trend_window                seconds of samples queue_status is given (the monitor keeps them)

Check your work:  msglab check 05   (or the last cell of lab.ipynb)
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
