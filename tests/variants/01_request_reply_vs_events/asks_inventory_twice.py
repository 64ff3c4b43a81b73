"""Wrong variant: a silent inventory is asked a second time before the order is refused.

"A lost answer deserves a second chance": the customer waits two request timeouts, and the inventory
gets the same question twice. The grader counts the requests the inventory received, so a loaded
machine that stretches one request's wait is not mistaken for this.
Expect: fail refuses_inventory_silent
Says: the inventory received 2 requests about it
Says: do not ask again
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
    for attempt in range(2):  # "a lost answer deserves a second chance"
        try:
            reply = await env.nc.request(env.subject("inventory.reserve"), data, timeout=env.request_timeout)
            break
        except nats.errors.NoRespondersError as exc:  # nobody listens: the server says so at once
            raise InventoryUnavailable(f"nobody answers for inventory: {order['id']} not accepted") from exc
        except nats.errors.TimeoutError as exc:  # no answer in time: ask once more, then give up
            if attempt == 1:
                raise InventoryUnavailable(f"no answer twice: {order['id']} not accepted") from exc
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
