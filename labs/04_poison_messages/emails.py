"""Lab 04: an email worker that retries what can succeed, dead-letters what never will, and a redrive tool.

The shop publishes one email request per order on `orders.email`; your worker sends each through
the email provider. The provider fails now and then, in ways you judge from the error alone: some
failures go away if you try again later, some never will. An email that can succeed must end sent;
one that cannot must end in the dead-letter queue (`orders.email.dlq`), once, with what went wrong;
and while one email waits for its retries, the others keep moving. Once a dead email's cause is
fixed, `redrive` sends it again. The task, as requirements, is in README.md.

What the grader (or the lab notebook) hands you in `env`:
  env.js, env.nc         JetStream and its connection
  env.stream("EMAILS"), env.durable("email")
                         the stream of email requests and your durable consumer on it (they exist;
                         the durable delivers an email at most env.max_deliver = 5 times)
  env.stream("EMAILS_DLQ"), env.subject("orders.email.dlq")
                         the DLQ stream (it exists) and the subject it stores
  env.subject("orders.email")
                         the subject the shop publishes email requests on
  await env.send_email(email)
                         sends one email (the message's JSON as a dict: order_id, to, template) and
                         returns the provider's message id, or raises what the provider answered:
                         env.EmailApiError (its .status is the HTTP status, e.g. 503 or 422) or
                         ConnectionResetError (the connection dropped)

Check your work:  msglab check 04   (or run the last cell of lab.ipynb)
"""

import json

FETCH_TIMEOUT = 0.3  # seconds a fetch waits for email (scaled down: production long-polls 5-30 s)


def is_transient(error) -> bool:
    """Will the same request go through later? Judged from the error alone."""
    # TODO: Tell a failure that can succeed later from one that never will, judging only from the error raised.
    return True


async def email_worker(env) -> None:
    """Send every email on the durable, forever (the grader kills and replaces this process)."""
    sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=FETCH_TIMEOUT)
        except TimeoutError:
            continue  # nothing to do yet: a worker keeps asking
        for msg in msgs:
            await handle(env, msg)


async def handle(env, msg) -> None:
    """One delivery: sent and acked, left to come back later, or dead-lettered."""
    try:
        await env.send_email(json.loads(msg.data))
    except Exception:
        # TODO: Retry a failure that can succeed later, with waits that grow, within the budget, without holding up the next email.
        # TODO: Move an email that will never be sent to the DLQ with all it needs, and settle it only once the DLQ has it, even when the DLQ refuses it on the email's last delivery.
        await msg.nak()
        return
    await msg.ack_sync()


async def dead_letter(env, msg, error) -> None:
    """Publish the failed email to the DLQ: its own bytes and headers, plus what went wrong and when."""
    # TODO: Make sure a worker killed between its DLQ publish and settling the email leaves the email in the DLQ once.


async def redrive(env, order_ids) -> int:
    """Send the dead-lettered emails of these orders again (their cause is fixed); return how many were republished."""
    # TODO: Republish the dead-lettered emails of these orders, so that a second run, or a run after a crash halfway, sends none of them twice.
    return 0
