"""Wrong variant: does nothing. The invoice worker blocks forever, so nothing is lost or
duplicated, vacuously, and no planned kill ever meets it: it scores nothing (lab.toml's requires).

Expect: fail faults_fired
"""

import json

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"  # can lose a message, and can also process one twice

# Which guarantee does each worker in workers.py give the invoice? One of the four names above.
GUARANTEES = {
    # TODO: Replace each None with the guarantee that worker gives: AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE or NEITHER.
    "core_subscriber": None,
    "ack_then_work": None,
    "work_then_ack": None,
    "ack_in_finally": None,
    "dedup_then_ack": None,
}


async def invoice_worker(env) -> None:
    """Invoice every request on the durable, forever (the grader kills and restarts this process)."""
    import asyncio

    await asyncio.Event().wait()  # blocks forever