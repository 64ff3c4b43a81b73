"""Wrong variant: an email the provider refused is logged, and its event acked anyway.

"The email failed, nothing to be done": the worker survives the outage, but the refused order's
confirmation never goes out, because an acked event never comes back.
Expect: fail survives_email_outage, no_lost_emails
Says: raised ConnectionError, and no email went out
Says: after the failed call: the worker reported the email done although it had failed
Says: settle its event only once the email went out
"""

import json

import nats.errors


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed: the inventory did not answer within env.request_timeout, or nobody listens."""


async def place_order(env, order: dict) -> None:
    """Accept one order by returning, or refuse it by raising; the customer sees the outcome at once."""
    data = json.dumps(order).encode()
    # A question: whether the order is possible decides what we tell the customer, so we ask and
    # wait, but only as long as the inventory is allowed to take. Both ways of getting no answer
    # mean the same to the customer: stock could not be confirmed, so the order is refused now.
    try:
        reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
    except nats.errors.NoRespondersError as exc:  # nobody listens: the server says so at once
        raise InventoryUnavailable(f"nobody answers for inventory: {order['id']} not accepted") from exc
    except nats.errors.TimeoutError as exc:  # the request arrived and no answer came in time
        raise InventoryUnavailable(f"no answer within {env.request_timeout} s: {order['id']} not accepted") from exc
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    # A fact: email and loyalty merely react to it, each from its own durable on this one subject,
    # so neither is called here, and neither being down can fail or slow this order. Announced
    # last, once nothing can refuse the order any more. js.publish returns once the stream has
    # stored the event (its PubAck) and raises when the stream refuses it: "accepted" is a promise
    # the stream has made. (If it raises, the order was saved but never announced; lesson 07's
    # transactional outbox closes that gap.)
    await env.js.publish(env.subject("orders.placed"), data)


async def email_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order = json.loads(msg.data)
            try:
                env.send_email(order["id"])
            except ConnectionError as exc:
                print(f"could not email {order['id']}: {exc}")
            await msg.ack_sync()
