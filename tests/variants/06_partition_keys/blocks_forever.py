"""Wrong variant: does nothing. Each partition's worker blocks forever, so nothing is lost or
duplicated, vacuously, and no planned kill ever meets it: it scores nothing (lab.toml's requires).

Expect: fail faults_fired
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
    import asyncio

    await asyncio.Event().wait()  # blocks forever