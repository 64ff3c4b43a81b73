"""Written differently: the age from the server's clock as a timedelta, an early return on an empty
queue, the trend as a slope, and the stream's refusal told apart by its class.

Expect: pass
"""

import datetime
import json

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


async def place_order(env, order) -> str:
    age = await queue_age(env)
    if age > env.age_budget:
        return BUSY
    try:
        ack = await env.js.publish(env.subject(SUBJECT), json.dumps(order).encode(), timeout=2)
    except ServiceUnavailableError:  # maximum messages exceeded: the stream is full
        return BUSY
    assert ack.seq > 0
    return ACCEPTED
