"""The solution, but each worker takes three events at a time, applies them, then acks the three, and nothing
bounds what its durable has in flight. A killed worker's batch comes back after ack_wait, behind what its
replacement applied meanwhile: events applied a second time after their order's next event (the state goes
backwards, although rule 6 excuses the second apply itself). The grader keeps the batch from coming back
until the replacement has asked and the durable has nothing more for it, so a replacement slow to start
(a loaded machine) meets the newer events first all the same.

Expect: fail per_key_order
Says: applied after a later event
"""

import asyncio
import zlib

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

STREAM = "SHOP_EVENTS"


def key_of(event) -> str:
    """Per-order order is what matters: the order id keeps an order's events together, and spreads."""
    return event.key


def partition_of(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n  # not hash(): Python salts it per process


async def publish(env, event, n: int) -> None:
    key = key_of(event)
    await env.js.publish(env.subject(f"shop.{n}.{partition_of(key, n)}.{key}"), event.to_bytes())


REPLAYED = b"replayed"  # the last message of a parked subject once its order was replayed: parked no more


def parked_subject(n: int, partition: int, key: str) -> str:
    return f"shop.parked.{n}.{partition}.{key}"


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
    )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(config.durable_name, stream)
    parked = await _still_parked(env, n, partition)  # from the stream: a replacement carries on
    while True:
        for key in list(parked):
            if await env.resolved(key) and await _replay(env, env.subject(parked_subject(n, partition, key))):
                parked.discard(key)
        try:
            msgs = await sub.fetch(3, timeout=0.2)
        except TimeoutError:
            continue
        for msg in msgs:  # the batch is acked once all of it is applied
            event = env.Event.from_bytes(msg.data)
            key = key_of(event)
            if key not in parked:
                try:
                    await env.apply(event)
                    continue
                except env.OrderRejected:
                    parked.add(key)
            await js.publish(env.subject(parked_subject(n, partition, key)), msg.data)
        for msg in msgs:
            await msg.ack_sync()


async def _read(env, subject: str, deliver: DeliverPolicy) -> list:
    """Every message on `subject` (a wildcard too) as an ephemeral consumer delivers it, up to the last one."""
    config = ConsumerConfig(
        filter_subject=subject, ack_policy=AckPolicy.NONE, deliver_policy=deliver, inactive_threshold=5.0
    )
    sub = await env.js.pull_subscribe(subject, stream=env.stream(STREAM), config=config)
    info = await sub.consumer_info()
    try:
        msgs = []
        while len(msgs) < info.num_pending:
            msgs += await sub.fetch(info.num_pending - len(msgs), timeout=1.0)
        return msgs
    finally:
        await sub.unsubscribe()  # the server drops the consumer once it is inactive


async def _still_parked(env, n: int, partition: int) -> set[str]:
    """The orders this partition parked and has not replayed: their subject's last message is an event."""
    last = await _read(env, env.subject(parked_subject(n, partition, "*")), DeliverPolicy.LAST_PER_SUBJECT)
    return {msg.subject.rsplit(".", 1)[1] for msg in last if msg.data != REPLAYED}


async def _replay(env, subject: str) -> bool:
    """Apply the events parked on `subject` since its last replay, in the order they were parked, then mark
    them replayed; False (nothing marked) if the order is refused again."""
    msgs = await _read(env, subject, DeliverPolicy.ALL)
    marks = [i for i, msg in enumerate(msgs) if msg.data == REPLAYED]
    for msg in msgs[marks[-1] + 1 if marks else 0 :]:
        try:
            await env.apply(env.Event.from_bytes(msg.data))
        except env.OrderRejected:
            return False
    await env.js.publish(subject, REPLAYED)
    return True
