"""Lab 07: the order pipeline's first hops: checkout's outbox write, the relay, the correlation id.

The shop's database (tables `orders`, `outbox`, `positions`: see README.md) is opened with
`env.open_store()`. The stream is `env.stream("ORDERS")`; order events go on `env.subject("orders.placed")`.
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
    # TODO: Every committed outbox row must reach the stream, in order, each confirmed by the stream.
    # TODO: The stream must be able to tell a resend of a row from a new event.
    # TODO: A relay started after a crash must resume where the stream is, not re-publish what it holds.
    # TODO: The relay must keep going through a restart of the server.
    await asyncio.Event().wait()
