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

import asyncio
import json

ACCEPTED, BUSY = "accepted", "busy"


async def queue_depth(env) -> int:
    """How many orders the durable has not seen acked: undelivered plus delivered-but-unacked."""
    info = await env.js.consumer_info(env.stream("ORDERS"), env.durable("fulfil"))
    return info.num_pending + info.num_ack_pending


async def queue_age(env) -> float:
    """Seconds the oldest order the fulfilment workers have not finished has waited; 0.0 when none waits."""
    # TODO: Measure how long the oldest unfinished order has waited, counting an order a worker holds without having acked it, and only the orders the durable delivers.
    return 0.0


def queue_status(samples, budget) -> str:
    """OK, WARNING or ERROR from the monitor's recent samples (oldest first), by the rule in README.md."""
    # TODO: Judge the queue by the level and the trend of its age, as README.md's rule says, never by its depth.
    depth = samples[-1].depth
    if depth >= 200:
        return "ERROR"
    if depth >= 50:
        return "WARNING"
    return "OK"


async def place_order(env, order) -> str:
    """ACCEPTED once the order is safely queued; BUSY when the shop cannot keep its promise now."""
    # TODO: Keep the promise to each order: BUSY for an order the workers would not finish within env.age_budget of storing it, and always while the queue age is over that budget; ACCEPTED whenever the shop can keep it, again as soon as the queue has recovered.
    # TODO: Answer ACCEPTED only for an order the stream has stored, so that a SIGKILL right after the answer loses nothing.
    # TODO: Answer BUSY when the stream refuses the order because it is full, instead of raising.
    # TODO: A publish whose confirmation does not come is an unknown outcome: answer as the stream holds the order (it may have stored it), and never let it hold the order twice. A customer waits two seconds at most.
    _outbox(env).put_nowait(order)  # answer at once: a background task publishes it
    return ACCEPTED


def _outbox(env) -> asyncio.Queue:
    """The intake's in-memory queue of orders to publish, and the task that empties it."""
    if not hasattr(env, "outbox"):
        env.outbox = asyncio.Queue()
        env.publisher = asyncio.ensure_future(_publish_forever(env, env.outbox))
    return env.outbox


async def _publish_forever(env, outbox) -> None:
    while True:
        order = await outbox.get()
        await env.js.publish(env.subject("orders.placed"), json.dumps(order).encode())
