"""Lab 01: an order service that keeps selling while email and loyalty stumble.

Placing an order needs one answer now: is there stock for it? Everything else that happens to an
order (the confirmation email, the loyalty points) merely reacts to it. So the order service asks
the inventory and waits, and announces every other consequence as one event on a stream.

What the grader (or the lab notebook) hands you in `env`:
  env.nc, env.js             a NATS connection and its JetStream context
  env.subject(name)          the subject to use for `name`, e.g. env.subject("orders.placed")
  env.stream(name)           the stream to use for `name`, e.g. env.stream("ORDERS")
  env.durable(name)          the durable consumer to use for `name`, e.g. env.durable("email")
  env.request_timeout        how long the inventory service may take to answer, in seconds
  env.save_order(order)      stores the order in the order service's own database
  env.send_email(order_id)   sends the confirmation email for one order through the email provider;
                             raises ConnectionError when the provider is down (then nothing went out)

What the platform runs already (README.md has the details):
  inventory      answers on "inventory.reserve": the order as JSON in, {"reserved": true|false} out
  loyalty        answers on "loyalty.award" (the order as JSON in), and reads every event on
                 "orders.placed" from its own durable "loyalty"
  stream ORDERS  stores "orders.>"; the durables "email" and "loyalty" deliver "orders.placed"

Check your work:  msglab check 01   (or the last cell of lab.ipynb)
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
    """The email service: one confirmation email per accepted order. Runs until it is stopped."""
    # The durable remembers what was acked, so a restarted worker goes on where the killed one
    # stopped; a consumer of our own would start again from the stream's first event.
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            # New events arrive during the wait at once; the timeout only bounds how long one
            # pull request lingers on the server.
            msgs = await sub.fetch(batch=10, timeout=0.5)
        except TimeoutError:
            # A quiet spell: nothing yet, so ask again. (An empty fetch raises the built-in
            # TimeoutError, or its subclass nats.errors.TimeoutError, depending on the batch size.)
            continue
        for msg in msgs:
            order = json.loads(msg.data)
            try:
                env.send_email(order["id"])
            except ConnectionError:
                # The email provider is down: this email is not done, so it is not acked. The broker
                # delivers the event again after ack_wait, by when the provider may be back; the
                # worker carries on with the next event meanwhile.
                continue
            # The ack goes after the email and is confirmed by the server: killed before this
            # line, the event comes back (an email may go out twice); never lost.
            await msg.ack_sync()
