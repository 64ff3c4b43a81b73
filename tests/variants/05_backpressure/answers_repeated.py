"""Wrong variant: tells the customer ACCEPTED before its publish is stored (a kill in between loses an
accepted order), after answering its first stored order ACCEPTED nine times over: on a grader that
counted every answer about a real order, the repeats absorbed intake A's planned SIGKILL (after its 4th
to 9th ACCEPTED) where it cost nothing. A planned kill counts an intake's first answer about an order
only, so it lands right after an acceptance whose order is not stored yet.

Expect: fail no_accepted_order_lost
"""

import asyncio
import json
import math
import time
from collections import deque

from nats.js.errors import APIError, NotFoundError

ACCEPTED, BUSY = "accepted", "busy"
RATE_WINDOW = 1.0  # seconds of calls the drain rate is measured over ...
RATE_SPAN = 0.1  # ... and at least this many
PUBLISH_TIMEOUT = 0.4  # seconds to wait for the stream's confirmation (nats-py's JetStream default: 5 s) ...
PUBLISH_TRIES = 4  # ... this many times: a customer has an answer within two seconds


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
        return BUSY
    if await forecast_wait(env) > env.age_budget:
        return BUSY
    oid = str(order["id"])
    first = not env.__dict__.setdefault("answered_one", False)
    if not first:
        env.world.call(ACCEPTED, oid)  # the mistake: the customer hears ACCEPTED before the stream has it
    body = json.dumps(order).encode()
    for _ in range(PUBLISH_TRIES):
        try:
            await env.js.publish(
                env.subject("orders.placed"), body, timeout=PUBLISH_TIMEOUT, headers={"Nats-Msg-Id": oid}
            )
        except TimeoutError:
            continue
        except APIError as exc:
            if exc.err_code == 10077:
                return BUSY
            raise
        if first:  # the trick: the first stored order answered nine times, where a kill costs nothing
            env.answered_one = True
            for _ in range(9):
                env.world.call(ACCEPTED, oid)
        return ACCEPTED
    return BUSY


async def forecast_wait(env) -> float:
    """Seconds an order placed now would wait: the orders ahead of it, and itself, over the rate the workers
    finish them (Little's law; the age trails this wait by the ratio of arrivals to drain rate).

    The rate is measured over this process's calls of the last second, only across spans that began with orders
    waiting: with none waiting, the workers finish what arrives, which says nothing of how fast they can go.
    """
    readings = env.__dict__.setdefault("finished_readings", deque())
    while True:
        info = await env.js.consumer_info(env.stream("ORDERS"), env.durable("fulfil"))
        depth = info.num_pending + info.num_ack_pending
        now, finished = time.monotonic(), info.delivered.consumer_seq - info.num_ack_pending
        readings.append((now, finished, depth))
        while now - readings[0][0] > RATE_WINDOW:
            readings.popleft()
        if depth == 0:
            return 0.0  # an empty queue always has room
        pairs = zip(list(readings)[:-1], list(readings)[1:], strict=True)
        spans = [(t2 - t1, f2 - f1) for (t1, f1, d1), (t2, f2, _) in pairs if d1]
        busy = sum(dt for dt, _ in spans)
        if busy >= RATE_SPAN:
            break
        await asyncio.sleep(RATE_SPAN)  # no rate measured with orders waiting: measure one now
    rate = sum(done for _, done in spans) / busy
    return (depth + 1) / rate if rate > 0 else math.inf
