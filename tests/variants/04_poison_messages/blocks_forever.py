"""Wrong variant: does nothing. The email worker blocks forever, so nothing is lost or
duplicated, vacuously, and no planned kill ever meets it: it scores nothing (lab.toml's requires).

Expect: fail faults_fired
"""

import json

FETCH_TIMEOUT = 0.3  # seconds a fetch waits for email (scaled down: production long-polls 5-30 s)


def is_transient(error) -> bool:
    """Will the same request go through later? Judged from the error alone."""
    # TODO: Tell a failure that can succeed later from one that never will, judging only from the error raised.
    return True


async def email_worker(env) -> None:
    """Send every email on the durable, forever (the grader kills and replaces this process)."""
    import asyncio

    await asyncio.Event().wait()  # blocks forever


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