"""Lab 06: a partitioned consumer group for the shop's order events.

Read README.md first. The grader runs this file in several processes of its own: two publishers that
call `publish` for the events it hands them (one order's events may come through either), and one
worker process per partition that calls `worker`. `msglab check 06` grades it.
"""

import zlib

from nats.js.api import AckPolicy, ConsumerConfig

STREAM = "SHOP_EVENTS"  # the platform's stream: it stores every subject under shop.>


def key_of(event) -> str:
    """The partition key of an event (event.key is the order id, event.customer the customer)."""
    # TODO: Choose the key that keeps each order's events in order and spreads a backlog over the partitions (one wholesale customer places most orders).
    return event.customer


def partition_of(key: str, n: int) -> int:
    """Which of n partitions (0 .. n-1) a key belongs to: the same in every process (Python's hash() is not)."""
    return zlib.crc32(key.encode()) % n


async def publish(env, event, n: int) -> None:
    """Hand one event to the stream, routed to one of n partitions; return once the stream confirmed it."""
    key = key_of(event)
    await env.js.publish(env.subject(f"shop.{n}.{partition_of(key, n)}.{key}"), event.to_bytes())


def durable_name(n: int, partition: int) -> str:
    return f"n{n}p{partition}"


async def worker(env, partition: int, n: int, previous: int) -> None:
    """Apply the events of `partition` of the n-partition layout, one process per partition, until stopped.

    `previous` is the number of partitions before a rescale (0: none).
    """
    js, stream = env.js, env.stream(STREAM)
    # TODO: After a rescale (previous > 0) the publishers do not pause: apply no event of a key before its events of the previous layout are applied and acked, and never let two workers hold one key at once.
    name = env.durable(durable_name(n, partition))
    config = ConsumerConfig(
        name=name,  # a durable's create names it twice: the course's server closes the legacy API
        durable_name=name,
        filter_subject=env.subject(f"shop.{n}.{partition}.*"),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=0.5,
        # TODO: Make sure an event the broker redelivers (its worker was killed) is never overtaken by the next event of its order.
    )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(name, stream)
    while True:
        try:
            msgs = await sub.fetch(1, timeout=0.2)
        except TimeoutError:
            continue
        for msg in msgs:
            event = env.Event.from_bytes(msg.data)
            # TODO: When env.apply raises env.OrderRejected, park the order: its later events wait in order while every other order flows.
            # TODO: Once env.resolved(key) is True, apply the parked order's events in order, the refused one first, and ack each one.
            await env.apply(event)
            await msg.ack_sync()
