"""Wrong variant: publishes an event, then waits for the email worker to confirm the email went out."""

import json

import nats.errors


class InventoryUnavailable(Exception):
    """The inventory service gave no answer in time, or nobody is listening."""


async def place_order(env, order: dict) -> None:
    """Accept an order: store it, then let the rest of the system know. Must work while email is down."""
    env.save_order(order)
    data = json.dumps(order).encode()
    # TODO: Publish the order as an event to env.subject("orders.placed") with env.js.publish instead of calling the email service.
    # "Make sure the email went out" before answering: the order path waits for email again.
    confirmed = await env.nc.subscribe(env.subject(f"emails.sent.{order['id']}"), max_msgs=1)
    await env.js.publish(env.subject("orders.placed"), data)
    await confirmed.next_msg(timeout=2.0)


async def email_worker(env) -> None:
    """Send one email per placed order, forever (the grader kills and restarts this process)."""
    # TODO: Bind a pull subscription to the durable env.durable("email") on env.stream("ORDERS") instead of answering requests.
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("ORDERS"))
    while True:
        try:
            msgs = await sub.fetch(batch=10, timeout=1)
        except TimeoutError:  # nothing to do yet: ask again
            continue
        for msg in msgs:
            order = json.loads(msg.data)
            env.send_email(order["id"])
            # TODO: Ack the message only now, after its email went out, and wait until the server has it.
            await msg.ack_sync()
            await env.nc.publish(env.subject(f"emails.sent.{order['id']}"), b"sent")


async def check_stock(env, sku: str) -> int:
    """Ask the inventory service how many of `sku` are in stock: an answer the caller needs now."""
    # TODO: Request {"sku": sku} as JSON on env.subject("inventory.check") with timeout=env.request_timeout and raise InventoryUnavailable when no answer comes.
    request = json.dumps({"sku": sku}).encode()
    try:
        reply = await env.nc.request(env.subject("inventory.check"), request, timeout=env.request_timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise InventoryUnavailable(f"no answer about {sku}: {type(exc).__name__}") from exc
    return json.loads(reply.data)["available"]
