"""Written differently: admission by the age against a margin, budget / 4, since the README says orders
can arrive up to about five times as fast as the workers finish them (the lesson: a threshold near budget / k);
a publish that times out is retried until a deadline, with the order's id as Nats-Msg-Id.

Expect: pass
"""

import json
import time

import nats.errors
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
    """BUSY while the oldest order has waited more than a quarter of the budget; otherwise publish and confirm."""
    if await queue_age(env) > env.age_budget / 4:
        return BUSY
    deadline = time.monotonic() + 1.5  # the customer has an answer within two seconds
    while time.monotonic() < deadline:
        try:
            await env.js.publish(
                env.subject("orders.placed"), json.dumps(order).encode(), timeout=0.3,
                headers={"Nats-Msg-Id": order["id"]},  # a retry is the same order: stored once
            )
            return ACCEPTED
        except nats.errors.TimeoutError:
            pass  # stored or not, unknown: publish it again
        except APIError as exc:
            if exc.err_code == 10077:
                return BUSY
            raise
    return BUSY
