"""One order's path by its correlation id: the header every hop carries, and the path rebuilt from the records.

    headers = carry(start=order["id"])        # the first hop (checkout) starts one
    headers = carry(msg, Reason="declined")   # every later hop carries the id of the message in hand
    path = await trace(js, "o-001", [stream], page)

One model for lesson 07 (msglab.demos.pipeline), its lab and its grader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msglab.world.outbox import CORRELATION_ID

if TYPE_CHECKING:  # only named: a grader that traces needs no web server
    from msglab.world.status_page import StatusPage


def carry(incoming: Any = None, *, start: str | None = None, **headers: str) -> dict[str, str]:
    """Headers for the next hop: `headers` plus the Correlation-Id of `incoming` (a message, or its headers);
    the first hop, with nothing to carry, starts one (`start`, e.g. the order id)."""
    given = getattr(incoming, "headers", incoming) or {}
    correlation_id = given.get(CORRELATION_ID) or start
    if not correlation_id:
        raise ValueError(f"no {CORRELATION_ID} to carry: the first hop starts one (start=...)")
    return {**headers, CORRELATION_ID: str(correlation_id)}


@dataclass(frozen=True)
class Hop:
    """One step of an order's path: when (time.time()), where it was recorded, what happened."""

    ts: float
    where: str
    what: str


@dataclass
class Trace:
    """One order's path through the services, oldest first, timed from its first hop."""

    correlation_id: str
    hops: list[Hop]

    @property
    def seconds(self) -> float:
        """From the first hop to the last."""
        return self.hops[-1].ts - self.hops[0].ts if self.hops else 0.0

    def __repr__(self) -> str:
        t0 = self.hops[0].ts if self.hops else 0.0
        lines = [f"{self.correlation_id}: {len(self.hops)} hops in {self.seconds * 1000:.1f} ms"]
        lines += [f"  +{(hop.ts - t0) * 1000:7.1f} ms  {hop.what:<28} {hop.where}" for hop in self.hops]
        return "\n".join(lines)


async def trace(js: Any, correlation_id: str, streams: Sequence[str] = (), page: StatusPage | None = None) -> Trace:
    """Rebuild one order's path: every message in `streams` carrying this Correlation-Id (stamped by the
    server when it stored it) and every change `page` showed that an event with this id brought (its own clock)."""
    hops = []
    for stream in streams:
        info = await js.stream_info(stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            if (msg.headers or {}).get(CORRELATION_ID) == correlation_id:
                hops.append(Hop(msg.time.timestamp(), f"{stream} #{seq}", str(msg.subject)))
    if page is not None:
        hops += [
            Hop(c.ts, "status page", f"shown {c.status}") for c in page.changes if c.correlation_id == correlation_id
        ]
    return Trace(correlation_id, sorted(hops, key=lambda hop: hop.ts))
