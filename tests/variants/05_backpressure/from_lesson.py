"""Lesson 05's own cells, pasted into the lab's file and renamed to env.*: queue_depth and queue_age
from section 1 ('Measure both'), the status rule of section 4, and place() of section 3 ('Refuse work
above a threshold') behind the admission check the lesson describes: BUSY while the age is over the
budget.

The lesson measured what that admission costs: the last order accepted before the refusals waited about
k times the budget (k: how much faster orders arrived than they were finished). In the rush the age is
under the budget while the queue already holds more work than the budget: those orders break the promise.
(promise_kept fails on an idle machine; with every core busy the rush runs at the machine's pace and
those waits can stay within it.) Its publish has no timeout of its own and no id: when the stream's
confirmation is lost, the customer waits nats-py's 5 s default, on every seed and under load.
Expect: fail stored_once
Says: waited for an answer that never came
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
    try:  # the first order after the ack floor, on the durable's own subject
        oldest = await env.js.get_msg(
            env.stream("ORDERS"), info.ack_floor.stream_seq + 1, subject=env.subject("orders.placed"), next=True
        )
    except NotFoundError:
        return 0.0  # nothing after the floor: every order is done
    return time.time() - oldest.time.timestamp()


def queue_status(samples, budget) -> str:
    """ERROR at or over the budget; WARNING when the age grew by at least half the window's span; OK."""
    (t0, age0, _), (t1, age1, _) = samples[0], samples[-1]
    if age1 >= budget:
        return "ERROR"
    if t1 > t0 and age1 - age0 >= 0.5 * (t1 - t0):
        return "WARNING"
    return "OK"


async def place_order(env, order) -> str:
    """The lesson's admission check on queue age, then its place()."""
    if await queue_age(env) > env.age_budget:
        return BUSY
    try:
        await env.js.publish(env.subject("orders.placed"), json.dumps(order).encode())
    except APIError as exc:
        if exc.err_code == 10077:  # maximum messages exceeded: the stream is full
            return BUSY
        raise
    return ACCEPTED
