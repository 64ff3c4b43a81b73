"""Wrong variant: the worker acks each event before sending its email, after first emailing four
orders nobody placed: on a grader that counted every call, those decoy calls absorbed each planned
kill while the worker held no event (it passed). A planned kill lands on the workload, so it falls
between an ack and its email, and the decoys are named.

Expect: fail effects_on_the_workload, no_lost_emails
Says: no message of this run carries
Says: acked before its email
"""

import contextlib
import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed in time, or nobody listens."""


async def place_order(env, order: dict) -> None:
    data = json.dumps(order).encode()
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise InventoryUnavailable(f"no stock answer for {order['id']}") from exc
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    await env.js.publish(env.subject("orders.placed"), data)


async def email_worker(env) -> None:
    for n in range(4):  # the decoys: emails about orders nobody placed (a crash plan counts up to 4)
        with contextlib.suppress(ConnectionError):  # the provider may be down for them too
            env.send_email(f"no-such-{n}")
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order = json.loads(msg.data)
            await msg.ack_sync()
            try:
                env.send_email(order["id"])
            except ConnectionError:  # the provider is down (not this variant's mistake): it comes back
                continue
