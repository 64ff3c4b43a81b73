"""Lab 06: a partitioned consumer group for the shop's order events.

Read README.md first. The grader runs this file in several processes of its own: two publishers that
call `publish` for the events it hands them (one order's events may come through either), and one
worker process per partition that calls `worker`. `msglab check 06` grades it.
"""

from nats.js.api import AckPolicy, ConsumerConfig

STREAM = "SHOP_EVENTS"  # the platform's stream: it stores every subject under shop.>


def key_of(event) -> str:
    """The partition key of an event (event.key is the order id, event.customer the customer)."""
    # TODO: Choose the key that keeps each order's events in order and spreads a backlog over the partitions (one wholesale customer places most orders).
    return event.customer


async def publish(env, event, n: int) -> None:
    """Hand one event to the stream, routed to one of n partitions; return once the stream confirmed it."""
    # TODO: Route each event to one of the n partitions by its key, to the same partition in every publisher process, so that each partition's worker can take exactly its partition's events (and one layout's events stay apart from another's).
    await env.js.publish(env.subject(f"shop.events.{key_of(event)}"), event.to_bytes())


async def worker(env, partition: int, n: int, previous: int) -> None:
    """Apply the events of `partition` of the n-partition layout, one process per partition, until stopped.

    `previous` is the number of partitions before a rescale (0: none).
    """
    js, stream = env.js, env.stream(STREAM)
    # TODO: After a rescale (previous > 0) the publishers do not pause: apply no event of a key before its events published with the previous layout are applied and acked, and never let two workers hold one key at once.
    # TODO: Take only this partition's events, and never let an event the broker redelivers (its worker was killed) be overtaken by the next event of its order.
    name = env.durable(f"worker{partition}")
    config = ConsumerConfig(
        name=name,  # a durable's create names it twice: the course's server closes the legacy API
        durable_name=name,
        filter_subject=env.subject("shop.events.*"),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=0.5,
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
            # TODO: When env.apply raises env.OrderRejected, park the order: its later events wait in order while every other order flows, and what is parked outlives this process (a worker started in its place carries on with it).
            # TODO: Once env.resolved(key) is True, apply the parked order's events in order, the refused one first.
            await env.apply(event)
            await msg.ack_sync()
