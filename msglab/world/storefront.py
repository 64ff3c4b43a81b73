"""Lesson 01's storefront: request-reply services that are up, down or silent; its inventory and loyalty.

One model for the lesson (msglab.demos.request_reply_vs_events: its Responder and order desk), the
lab's playground and its grader (msglab.graders.request_reply_vs_events), so what the lesson shows
and what the grader judges are the same services:

    Responder   a request-reply service on one subject: up (answers), down (not subscribed: a caller
                hears "no responders" at once) or silent (subscribed, never answers: the caller waits
                for its timeout)
    Storefront  the lab's inventory (answers `inventory.reserve` by the order's sku) and loyalty
                (answers `loyalty.award`, and reads every order event from its own durable), telling
                a `record` function everything they see: the grader keeps it as evidence, the
                playground prints it
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from msglab.broker import connect, settle_subscriptions

STATES = ("up", "down", "silent")
INVENTORY, LOYALTY_ASK = "inventory.reserve", "loyalty.award"

# record(kind, name, order id, **detail): kind "effect" (loyalty awarded points) or "note" (what a service saw)
Record = Callable[..., None]


class Responder:
    """A request-reply service on one subject that can be taken up, down, or made silent.

    `answer` is the reply (bytes), or a function from the request's data to the reply (None: this
    request gets no answer). `received` counts requests that reached the service, `answered` the
    ones it replied to.
    """

    def __init__(self, nc: Any, subject: str, answer: bytes | Callable[[bytes], bytes | None]) -> None:
        self.nc = nc
        self.subject = subject
        self.answer = answer
        self.state = "down"
        self.received = 0
        self.answered = 0
        self.owns_connection = False  # close() closes the connection only if start() opened it
        self._sub: Any = None

    @classmethod
    async def start(
        cls,
        subject: str,
        answer: bytes | Callable[[bytes], bytes | None] = b"ok",
        *,
        state: str = "up",
        url: str | None = None,
    ) -> Responder:
        """Connect and start answering on `subject` (or start down or silent)."""
        nc = await connect(url, name=f"msglab-responder-{subject}")
        responder = cls(nc, subject, answer)
        responder.owns_connection = True
        await responder.set_state(state)
        return responder

    async def set_state(self, state: str) -> None:
        """Go 'up', 'down' or 'silent'; returns once the server knows, so the next request sees it."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, not {state!r}")
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        if state != "down":
            self._sub = await self.nc.subscribe(self.subject, cb=self._on_request)
        self.state = state
        await settle_subscriptions(self.nc)  # the next request, from any connection, sees the new state

    async def up(self) -> None:
        """Answer requests."""
        await self.set_state("up")

    async def down(self) -> None:
        """Stop listening: requests fail at once with NoRespondersError."""
        await self.set_state("down")

    async def silent(self) -> None:
        """Listen but never answer: requests fail with TimeoutError after their timeout."""
        await self.set_state("silent")

    async def _on_request(self, msg: Any) -> None:
        self.received += 1
        if self.state != "up":
            return  # silent: the request arrived and is dropped on the floor
        reply = self.answer(msg.data) if callable(self.answer) else self.answer
        if reply is None or not msg.reply:  # no answer for this one, or nobody waits for it
            return
        await msg.respond(reply)
        self.answered += 1

    async def close(self) -> None:
        """Stop; close the service's connection if it has its own. The next request sees nobody listening."""
        if not self.nc.is_closed:
            await self.set_state("down")
            if self.owns_connection:
                await self.nc.close()
        self.state = "down"

    def __repr__(self) -> str:
        return f"<Responder {self.subject} {self.state}: {self.received} received, {self.answered} answered>"


def order_id(data: bytes) -> str | None:
    """The order id an event or request carries: the order as JSON, {"id": ...} (or {"order": {...}})."""
    body = _json(data)
    if isinstance(body.get("id"), str):
        return str(body["id"])
    inner = body.get("order")
    if isinstance(inner, dict) and isinstance(inner.get("id"), str):
        return str(inner["id"])
    return None


def sku(data: bytes) -> str | None:
    """The sku an inventory request names, if any."""
    body = _json(data)
    inner = body["order"] if isinstance(body.get("order"), dict) else body
    return str(inner["sku"]) if "sku" in inner else None


def _json(data: bytes) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


class Storefront:
    """The lab's inventory and loyalty on one connection (`names` maps the course's names to the run's).

    Inventory answers {"reserved": false} for a sku in `no_stock` (or a request naming none), ignores
    one in `silent_skus`, else reserves. Loyalty awards points when asked, except for orders in
    `silent_ids`, and reads every order event from its durable while it is up, acking each once done.
    `set(service, state)` takes either up, down or silent; `awarded` lists the points so far.
    """

    def __init__(
        self,
        nc: Any,
        js: Any,
        names: Any,
        record: Record,
        *,
        stream: str = "ORDERS",
        durable: str = "loyalty",
        no_stock: Collection[str] = (),
        silent_skus: Collection[str] = (),
        silent_ids: Collection[str] = (),
        ids_by_sku: Mapping[str, str] | None = None,
    ) -> None:
        self.js, self.names, self.record = js, names, record
        self.stream, self.durable = stream, durable
        self.no_stock, self.silent_skus, self.silent_ids = set(no_stock), set(silent_skus), set(silent_ids)
        self.ids_by_sku = dict(ids_by_sku or {})  # names the order of a request that carries only its sku
        self.services = {
            "inventory": Responder(nc, names.subject(INVENTORY), self._reserve),
            "loyalty": Responder(nc, names.subject(LOYALTY_ASK), self._award),
        }
        self.awarded: list[tuple[str, str]] = []  # (order id, "request" or "event")
        self._reading = asyncio.Event()  # set while loyalty is up: its events wait on the durable otherwise
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Both services up, and loyalty reading its durable."""
        for service in self.services.values():
            await service.up()
        self._reading.set()
        sub = await self.js.pull_subscribe_bind(self.names.durable(self.durable), self.names.stream(self.stream))
        self._task = asyncio.ensure_future(self._read_events(sub))

    async def set(self, service: str, state: str) -> None:
        """Take 'inventory' or 'loyalty' 'up', 'down' (nobody listens) or 'silent' (listens, never answers)."""
        if service not in self.services or state not in STATES:
            raise ValueError("set(service, state): service 'inventory' or 'loyalty', state up, down or silent")
        await self.services[service].set_state(state)
        if service == "loyalty" and state == "up":
            self._reading.set()
        elif service == "loyalty":
            self._reading.clear()

    async def stop(self) -> None:
        """Stop reading events (bounded: nats-py's fetch can swallow a cancellation)."""
        self._stopping = True
        self._reading.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2.0)

    def _reserve(self, data: bytes) -> bytes | None:
        wanted = sku(data)
        oid = order_id(data) or self.ids_by_sku.get(wanted or "")
        if wanted in self.silent_skus:
            self.record("note", "inventory_ignored", oid, sku=wanted)
            return None  # silent for this sku: the request arrived and is dropped on the floor
        reserved = wanted is not None and wanted not in self.no_stock
        self.record("note", "inventory_answered", oid, sku=wanted, reserved=reserved)
        return json.dumps({"reserved": reserved}).encode()

    def _award(self, data: bytes) -> bytes | None:
        oid = order_id(data)
        if oid is None:
            self.record("note", "loyalty_unreadable", None, data=data[:80])
        elif oid in self.silent_ids:
            self.record("note", "loyalty_ignored", oid)
            return None
        else:
            self.awarded.append((oid, "request"))
            self.record("effect", "award_points", oid, via="request")
        return b'{"ok": true}'

    async def _read_events(self, sub: Any) -> None:
        # Loyalty's own durable: every order event, at its own pace, each acked once its points are given.
        while not self._stopping:
            await self._reading.wait()
            try:
                msgs = await sub.fetch(50, timeout=0.2)
            except TimeoutError:
                continue
            except Exception:  # the connection is closing: the run or the playground is over
                return
            for msg in msgs:
                oid, seq = order_id(msg.data), msg.metadata.sequence.stream
                if oid is None:
                    self.record("note", "loyalty_unreadable", None, seq=seq, data=msg.data[:80])
                else:
                    self.awarded.append((oid, "event"))
                    self.record("effect", "award_points", oid, via="event", seq=seq)
                with contextlib.suppress(Exception):
                    await msg.ack_sync()
