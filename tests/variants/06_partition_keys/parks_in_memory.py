"""The solution, but a refused order's events are set aside in the worker's memory (acked, kept in a list) and
applied from there once the order is resolved: when that worker dies, what it parked dies with it.

Expect: fail parked_key_resumes_in_order
Says: never replayed the parked order
"""

import asyncio
import zlib

from nats.js.api import AckPolicy, ConsumerConfig

STREAM = "SHOP_EVENTS"


def key_of(event) -> str:
    """Per-order order is what matters: the order id keeps an order's events together, and spreads."""
    return event.key


def partition_of(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n  # not hash(): Python salts it per process


async def publish(env, event, n: int) -> None:
    key = key_of(event)
    await env.js.publish(env.subject(f"shop.{n}.{partition_of(key, n)}.{key}"), event.to_bytes())


def durable_name(n: int, partition: int) -> str:
    return f"n{n}p{partition}"


async def _layout_drained(env, n: int) -> bool:
    for p in range(n):
        try:
            info = await env.js.consumer_info(env.stream(STREAM), env.durable(durable_name(n, p)))
        except Exception:
            return False  # not created yet: its worker has not started
        if info.num_pending or info.num_ack_pending:
            return False
    return True


async def worker(env, partition: int, n: int, previous: int) -> None:
    js, stream = env.js, env.stream(STREAM)
    if previous:
        # A moved key's older events may still wait in the old layout's partitions.
        while not await _layout_drained(env, previous):  # noqa: ASYNC110 (the condition lives on the broker)
            await asyncio.sleep(0.05)
    name = env.durable(durable_name(n, partition))
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=env.subject(f"shop.{n}.{partition}.*"),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=0.5,
        max_ack_pending=1,  # one event in flight: a redelivery is never overtaken
    )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(config.durable_name, stream)
    parked: dict[str, list] = {}  # order id -> its events set aside, in arrival order (acked)
    while True:
        for key in list(parked):
            if await env.resolved(key):
                for event in parked.pop(key):
                    await env.apply(event)
        try:
            msgs = await sub.fetch(1, timeout=0.2)
        except TimeoutError:
            continue
        for msg in msgs:
            event = env.Event.from_bytes(msg.data)
            key = key_of(event)
            if key not in parked:
                try:
                    await env.apply(event)
                    await msg.ack_sync()
                    continue
                except env.OrderRejected:
                    parked[key] = []
            parked[key].append(event)
            await msg.ack_sync()
