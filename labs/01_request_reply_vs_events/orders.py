"""Lab 01: an order service that keeps selling while email and loyalty stumble.

Today `place_order` asks three services and waits for each answer: inventory (is there stock?),
email (send the confirmation) and loyalty (award the points). While any of them is down or slow,
nobody can order. Decide which of these calls the order really needs an answer to, and change the
order service and the email service so that the business rules in README.md hold.

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


class OutOfStock(Exception):
    """The inventory answered: not enough stock for this order."""


class InventoryUnavailable(Exception):
    """Stock could not be confirmed: the inventory did not answer within env.request_timeout, or nobody listens."""


async def place_order(env, order: dict) -> None:
    """Accept one order by returning, or refuse it by raising; the customer sees the outcome at once."""
    data = json.dumps(order).encode()
    # TODO: Accept an order only once the inventory has confirmed its stock, and when that confirmation does not come within env.request_timeout (or nobody is there to give it), refuse the order at once with InventoryUnavailable.
    reply = await env.nc.request(env.subject("inventory.reserve"), data)
    if not json.loads(reply.data)["reserved"]:
        raise OutOfStock(f"no stock for order {order['id']}")
    env.save_order(order)
    # TODO: Make sure that nothing which merely reacts to an order can make placing it slow or fail, while every accepted order still reaches each of those services exactly once, even if they are down right now.
    await env.nc.request(env.subject("email.send"), data)
    await env.nc.request(env.subject("loyalty.award"), data)
    # TODO: Return (accepted) only once the order's announcement is stored where the reacting services will find it, and raise when it could not be stored; a refused order must never reach them.


async def email_worker(env) -> None:
    """The email service: one confirmation email per accepted order. Runs until it is stopped."""
    # TODO: Email every accepted order once, even when this process is killed at any moment and started again, and keep running through quiet spells with nothing to email.
    # TODO: When the email provider is down (env.send_email raises ConnectionError: nothing went out), that order's email must still go out once the provider is back, and the worker must keep serving the other orders meanwhile.
    sub = await env.nc.subscribe(env.subject("email.send"))
    async for msg in sub.messages:
        order = json.loads(msg.data)
        env.send_email(order["id"])
        await msg.respond(b"sent")
