"""Written differently: the age from the server's clock as a timedelta, an early return on an empty
queue, the trend as a slope, the stream's refusal told apart by its class, and admission by a forecast:
a background task tracks how fast the ack floor advances, and an order is refused when the orders
ahead of it would take longer than the budget at that pace; a publish without a confirmation is
asked again a few times, under a message id of its own making.

Expect: pass
"""

import asyncio
import collections
import datetime
import json
import time

from nats.js.errors import NotFoundError, ServiceUnavailableError

ACCEPTED, BUSY = "accepted", "busy"
STREAM, DURABLE, SUBJECT = "ORDERS", "fulfil", "orders.placed"


async def queue_depth(env) -> int:
    info = await env.js.consumer_info(env.stream(STREAM), env.durable(DURABLE))
    return info.num_pending + info.num_ack_pending


async def queue_age(env) -> float:
    info = await env.js.consumer_info(env.stream(STREAM), env.durable(DURABLE))
    if info.num_pending + info.num_ack_pending == 0:
        return 0.0
    first_unacked = info.ack_floor.stream_seq + 1
    try:
        msg = await env.js.get_msg(env.stream(STREAM), first_unacked, subject=env.subject(SUBJECT), next=True)
    except NotFoundError:  # acked between the two calls
        return 0.0
    waited = datetime.datetime.now(datetime.timezone.utc) - msg.time
    return max(waited.total_seconds(), 0.0)


def queue_status(samples, budget) -> str:
    t0, age0, _ = samples[0]
    t1, age1, _ = samples[-1]
    if age1 >= budget:
        return "ERROR"
    if t1 > t0 and (age1 - age0) / (t1 - t0) >= 0.5:
        return "WARNING"
    return "OK"


class Pace:
    """The ack floor's advance over the last half second, sampled every 50 ms by a task of its own."""

    def __init__(self, env):
        self.env = env
        self.points = collections.deque(maxlen=11)
        self.task = asyncio.ensure_future(self.run())

    async def run(self):
        while True:
            info = await self.env.js.consumer_info(self.env.stream(STREAM), self.env.durable(DURABLE))
            self.points.append((time.monotonic(), info.ack_floor.consumer_seq))
            await asyncio.sleep(0.05)

    def per_second(self):
        if len(self.points) < 3:
            return None
        (t0, n0), (t1, n1) = self.points[0], self.points[-1]
        return (n1 - n0) / (t1 - t0)


async def place_order(env, order) -> str:
    if not hasattr(env, "pace"):
        env.pace = Pace(env)
    age = await queue_age(env)
    if age > env.age_budget:
        return BUSY
    depth = await queue_depth(env)
    if depth:
        rate = env.pace.per_second()
        if rate is None:  # no pace measured yet
            if age > env.age_budget / 4:
                return BUSY
        elif rate <= 0 or (depth + 1) / rate > env.age_budget:
            return BUSY
    for _ in range(6):
        try:
            ack = await env.js.publish(
                env.subject(SUBJECT), json.dumps(order).encode(), timeout=0.25,
                headers={"Nats-Msg-Id": f"order:{order['id']}"},
            )
        except ServiceUnavailableError:  # maximum messages exceeded: the stream is full
            return BUSY
        except asyncio.TimeoutError:  # no confirmation: ask again; the same id is stored once
            continue
        assert ack.seq > 0
        return ACCEPTED
    return BUSY
