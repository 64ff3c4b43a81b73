"""Wrong variant: lesson 01's own cells, pasted into the lab's file and renamed to env.*.

place_order asks the inventory with a timeout and turns NoRespondersError and TimeoutError into the
refusal (the lesson's cells 8 and 10 catch both), then publishes with js.publish (cell 15); the email
worker is cell 17's loop (fetch, email, ack_sync), kept running through empty fetches as the TODO says.
Nothing in the lesson's worker expects env.send_email itself to fail: when the email provider is down,
the ConnectionError ends the worker, and the refused order is never emailed.
Expect: fail survives_email_outage, no_unplanned_deaths
Says: a failed email ended the worker
Says: raised ConnectionError
"""

import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed: the inventory did not answer within env.request_timeout, or nobody listens."""


async def place_order(env, order: dict) -> None:
    data = json.dumps(order).encode()
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except nats.errors.NoRespondersError as exc:
        raise InventoryUnavailable(type(exc).__name__) from exc
    except nats.errors.TimeoutError as exc:
        raise InventoryUnavailable(type(exc).__name__) from exc
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    await env.js.publish(env.subject("orders.placed"), data)


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            for msg in await sub.fetch(10, timeout=0.2):
                env.send_email(json.loads(msg.data)["id"])  # the email goes out...
                await msg.ack_sync()  # ...then the ack
        except TimeoutError:
            continue
