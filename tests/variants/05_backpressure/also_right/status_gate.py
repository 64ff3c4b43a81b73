"""Written differently: a Monitor class, the intake admits by the monitor's own status on a budget of
its own (a quarter of the promise: a margin for orders arriving faster than they are finished), and every
order is published with its id as Nats-Msg-Id, so a retried publish is stored once.

Expect: pass
"""

import json
import time

from nats.js.errors import APIError, NotFoundError

ACCEPTED, BUSY = "accepted", "busy"
STREAM_FULL = 10077


class Monitor:
    def __init__(self, env):
        self.env = env
        self.stream = env.stream("ORDERS")
        self.durable = env.durable("fulfil")
        self.subject = env.subject("orders.placed")

    async def oldest_unfinished(self):
        info = await self.env.js.consumer_info(self.stream, self.durable)
        try:
            return await self.env.js.get_msg(self.stream, info.ack_floor.stream_seq + 1, subject=self.subject, next=True)
        except NotFoundError:
            return None

    async def age(self) -> float:
        msg = await self.oldest_unfinished()
        return 0.0 if msg is None else max(0.0, time.time() - msg.time.timestamp())


def _monitor(env) -> Monitor:
    if not hasattr(env, "monitor"):
        env.monitor = Monitor(env)
    return env.monitor


async def queue_depth(env) -> int:
    info = await env.js.consumer_info(env.stream("ORDERS"), env.durable("fulfil"))
    return info.num_pending + info.num_ack_pending


async def queue_age(env) -> float:
    return await _monitor(env).age()


class _Reading:
    def __init__(self, t, age):
        self.t, self.age = t, age


def queue_status(samples, budget) -> str:
    first, last = samples[0], samples[-1]
    level = "ERROR" if last.age >= budget else "OK"
    rising = len(samples) > 1 and last.t > first.t and last.age - first.age >= (last.t - first.t) / 2
    if level == "OK" and rising:
        return "WARNING"
    return level


async def place_order(env, order) -> str:
    now = _Reading(time.time(), await queue_age(env))
    # Orders may arrive up to about five times as fast as they are finished (README), and a new order waits about
    # that many times the age: the intake holds itself to a quarter of the budget.
    if queue_status([now], env.age_budget / 4) == "ERROR":
        return BUSY
    return await _publish_until_answered(env, order)


async def _publish_until_answered(env, order, tries=3) -> str:
    """A publish whose confirmation is lost is an unknown outcome: the same message again settles it."""
    try:
        await env.js.publish(
            env.subject("orders.placed"), json.dumps(order).encode(), timeout=0.5,
            headers={"Nats-Msg-Id": str(order["id"])},
        )
    except APIError as exc:
        if exc.err_code == STREAM_FULL:
            return BUSY
        raise
    except TimeoutError:
        return await _publish_until_answered(env, order, tries - 1) if tries > 1 else BUSY
    return ACCEPTED
