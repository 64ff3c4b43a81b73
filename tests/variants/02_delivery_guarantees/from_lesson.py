"""Wrong variant, built from lesson 02's own cells as a learner would paste them: `ack_confirmed`
(charge, `ack_sync()`, then report), the failure cells' `nak()` for a failure that may pass and
`term()` for one that never will, and the guarantees the lesson's table names. The invoicing
service is restarting: the immediate `nak()` is the lesson's own hot loop, hundreds of tries a
second at a service that is trying to come back up. And the lesson's heartbeat lived in a loop
of the job's own steps; here the long wait is one call, and nothing keeps the big invoice's claim.

Expect: fail retries_spaced, keeps_claim
Says: hot loop
Says: another worker of the group
"""

import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"

GUARANTEES = {
    "core_subscriber": AT_MOST_ONCE,  # section 1: core NATS keeps nothing
    "ack_then_work": AT_MOST_ONCE,  # ack_first
    "work_then_ack": AT_LEAST_ONCE,  # ack_after
    "ack_in_finally": NEITHER,  # "an ack in a finally acks a failed charge too, and gets both"
    "dedup_then_ack": EFFECTIVELY_ONCE,  # section 5
}


async def invoice_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("invoicer"), env.stream("BILLING"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.25)
        except TimeoutError:
            continue
        for msg in msgs:
            order_id = json.loads(msg.data)["order_id"]
            try:
                await env.send_invoice(order_id)  # ack_confirmed: the work first...
            except env.ServiceUnavailable:
                await msg.nak()  # "failed: send it again"
                continue
            except env.AccountClosed as err:
                env.reject(order_id, str(err))
                await msg.term()  # "term for one that never will"
                continue
            await msg.ack_sync()  # returns once the server has recorded the ack
            env.settled(order_id)  # env.done in the lesson
