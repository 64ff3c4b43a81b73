"""The lesson's cells pasted: the starter's routing, the demo's drain before the new layout starts
(`_until_acked`) and its park loop (`Shop.poison`: the parked keys in a set in memory, the events on a
subject of their own). The lesson's worker never dies while an order is parked; here it does.

Expect: fail parked_key_resumes_in_order
Says: never replayed the parked order
"""

import asyncio, time
import zlib
from nats.js.api import AckPolicy, ConsumerConfig

STREAM = "SHOP_EVENTS"


def key_of(event) -> str:
    return event.key


def partition_of(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n


async def publish(env, event, n: int) -> None:
    key = key_of(event)
    await env.js.publish(env.subject(f"shop.{n}.{partition_of(key, n)}.{key}"), event.to_bytes())


def durable_name(n: int, partition: int) -> str:
    return f"n{n}p{partition}"


async def _until_acked(js, stream, durables, timeout=30.0):
    give_up = time.monotonic() + timeout
    for name in durables:
        while True:
            info = await js.consumer_info(stream, name)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            if time.monotonic() > give_up:
                raise TimeoutError(f"durable {name} did not drain in {timeout:.0f} s")
            await asyncio.sleep(0.01)


async def worker(env, partition: int, n: int, previous: int) -> None:
    js, stream = env.js, env.stream(STREAM)
    if previous:
        await _until_acked(js, stream, [env.durable(durable_name(previous, p)) for p in range(previous)])
    name = env.durable(durable_name(n, partition))
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=env.subject(f"shop.{n}.{partition}.*"),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=0.5,
        max_ack_pending=1,
    )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(name, stream)
    parked = set()
    while True:
        try:
            msgs = await sub.fetch(1, timeout=0.2)
        except TimeoutError:
            msgs = []
        for msg in msgs:
            event = env.Event.from_bytes(msg.data)
            if event.key in parked:
                await js.publish(env.subject(f"shop.parked.{event.key}"), msg.data)
                await msg.ack_sync()
                continue
            try:
                await env.apply(event)
                await msg.ack_sync()
            except env.OrderRejected:
                parked.add(event.key)
                await js.publish(env.subject(f"shop.parked.{event.key}"), msg.data)
                await msg.ack_sync()
        for key in list(parked):
            if await env.resolved(key):
                aside = await js.pull_subscribe(env.subject(f"shop.parked.{key}"), stream=stream)
                try:
                    for m in await aside.fetch(100, timeout=1):
                        await env.apply(env.Event.from_bytes(m.data))
                        await m.ack_sync()
                except TimeoutError:
                    pass
                await aside.unsubscribe()
                parked.discard(key)
