"""Wrong variant: does nothing. The relay (the starter's own; checkout is the starter's too) blocks forever, so nothing is lost or
duplicated, vacuously, and no planned kill ever meets it: it scores nothing (lab.toml's requires).

Expect: fail faults_fired
"""

from __future__ import annotations

import asyncio
from typing import Any


async def checkout(env: Any, order: dict[str, Any], correlation_id: str) -> None:
    """Place one order (a dict with id, customer, cents); return once it is placed."""
    # TODO: The order and its outbox row must commit together, or neither, whenever the process dies.
    # TODO: The outbox row must hold the order event and the order's correlation id for every later hop.


async def relay(env: Any) -> None:
    """Publish the outbox to the stream, for as long as the process lives."""
    import asyncio

    await asyncio.Event().wait()  # blocks forever