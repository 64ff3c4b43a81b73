"""Lesson 07's plumbing: the dual write and the relay's resend, in real processes under real SIGKILLs.

    result = await pipeline.dual_write("commit_then_publish", orders=50, kills=5, seed=1)
    result.lost, result.phantom, pipeline.table(result, other)   # other runs side by side
    resend = await pipeline.relay_resend()                       # the relay dies after an ack, before saving
    resend = await pipeline.relay_resend(window=0.5, past_window=True)   # ... and stays down past the window

`dual_write` runs a checkout process (the grading harness's service role, as msglab.demos.idempotency
runs its workers) that places `orders` seeded orders one request at a time, in one of three ways:
`commit_then_publish`, `publish_then_commit` or `with_outbox` (the functions below, shown by the
lesson; a lesson cell may pass a function of its own, written the same way). Each checkout calls
`env.kill_point("between", order)` between its two writes; for `kills` orders drawn from the seed the
run SIGKILLs the process there, and the next order goes to a fresh process (the customer whose
checkout died saw an error and did not retry). A relay process (msglab.world.relay) publishes
whatever the outbox holds; with `relay_kills` it is SIGKILLed after the stream acked a row and before
it saved its position, and a fresh relay takes over. The outcome is counted from the shop's database
and from the stream, never from what a process printed: `lost` orders were committed and never
published, `phantom` events name an order that was never committed, `twice` orders were stored twice.

`carry(msg)` and `trace(js, correlation_id, streams, page)` live in msglab.world.correlation (re-exported here):
checkout starts the `Correlation-Id` (the order id) in its outbox rows' headers, each later hop copies it.

`relay_resend` shows why a relay may resend and who catches it: the relay dies between the stream's
ack and saving its position, and the next relay publishes that row again. Inside the stream's
duplicate window the stream drops it (its PubAck says `duplicate`); a relay that stays down longer
than the window (`window=0.5`: the run waits until the server has forgotten a Msg-Id it saw as the
relay died) gets it stored twice, and the consumer must recognise the copy then (the idempotency key at the
gateway for the charge, a dedup table for its own writes). `as_payments(resend.events, tag)` turns what the
stream holds into lesson 03's payments, so its bench (msglab.demos.idempotency) and gateway replay the double
charge; `double_charged(bench, payments)` counts it, `twice(bench, payments)` the double charges and credits per
order.

`Shop` is the whole pipeline live: checkout (the notebook) writes the outbox; the course's relay (`python -m
msglab.world.shop_services relay`), payments, email and the status page (msglab.world.shop_services), lesson 03's
gateway and module 04's email provider each run as a process of their own. `stall()`/`release()` stop
payments' process and start a new one, `crash_payments(order)` SIGKILLs payments between a charge and its ack,
`watch()` reads lag per consumer and DLQ depth once each order's event is stored (it asks the stream every 5 ms
until its last event is that order's), `settled()` waits for the page
and the consumers, `trace()` rebuilds one order's path (the stream, the page's pushes, the gateway's and the
provider's records), `receipts()` reads the provider's; `close()` stops every process and removes the streams
and folders.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from msglab.demos.delivery_guarantees import write_handler
from msglab.grading.harness import Child, Run
from msglab.grading.nemesis import rng
from msglab.grading.rules import plural
from msglab.grading.sandbox import Sandbox
from msglab.grading.scaffold import HeldSpawns, held
from msglab.world.correlation import Hop as Hop  # re-exported: lesson 07 and its tests name them here
from msglab.world.correlation import Trace, carry
from msglab.world.correlation import trace as trace  # re-exported, as Hop
from msglab.world.outbox import (
    CORRELATION_ID,
    INSERT_ORDER,
    INSERT_OUTBOX,
    counts,
    event,
    open_store,
    order_ids,
    place_order,
)
from msglab.world.relay import MSG_ID, Relay
from msglab.world.shop_services import CARD_LIMIT, READY_TIMEOUT, TEMPLATES, Service

STREAM = "ORDERS"
SUBJECT = "orders.placed"
PROBE = "orders.probe"  # the run's own marker for "has the server forgotten a Msg-Id this old?"
DEFAULT_WINDOW = 120.0  # seconds: JetStream's default duplicate window
CALL_TIMEOUT = 10.0  # the longest one checkout request may take (a loaded machine; it takes milliseconds)
SANDBOX = "a lesson's own experiment, run as the notebook's user"


# --- the three checkouts: what a lesson cell shows -------------------------------------------------


async def commit_then_publish(env: Any, order: dict[str, Any]) -> None:
    with env.db:
        env.db.execute(INSERT_ORDER, order)
    env.kill_point("between", order)
    await env.js.publish(env.placed, json.dumps(order).encode())


async def publish_then_commit(env: Any, order: dict[str, Any]) -> None:
    await env.js.publish(env.placed, json.dumps(order).encode())
    env.kill_point("between", order)
    with env.db:
        env.db.execute(INSERT_ORDER, order)


async def with_outbox(env: Any, order: dict[str, Any]) -> None:
    with env.db:
        env.db.execute(INSERT_ORDER, order)
        env.kill_point("between", order)  # the SIGKILL lands inside the open transaction
        row = {"id": order["id"], "subject": env.placed, "payload": json.dumps(order).encode(), "headers": "{}"}
        env.db.execute(INSERT_OUTBOX, row)


VARIANTS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (commit_then_publish, publish_then_commit, with_outbox)
}


# --- what runs inside the processes ----------------------------------------------------------------


def ops_checkout(env: Any, learner: Any) -> dict[str, Callable[..., Any]]:
    """A checkout process: one `place` request per order, handled by the lesson's checkout function."""
    env.db = open_store(env.params["db_path"])
    env.kill_point = lambda name, order: env.world.call(name, str(order["id"]))  # a planned SIGKILL lands here
    handler = getattr(learner, env.params["handler"])

    async def place(order: dict[str, Any]) -> str:
        await handler(env, order)
        return str(order["id"])

    return {"place": place}


async def role_relay(env: Any, learner: Any) -> None:
    """A relay process: held until its turn, then the course's relay on the shop's database, for ever."""
    relay = Relay(open_store(env.params["db_path"]), env.js, poll=env.params.get("poll", 0.02))

    def published(point: str, row: Any) -> None:
        last = relay.sent[-1]  # the stream's answer, as this relay saw it
        env.world.note("acked", str(row.id), seq=last.seq, duplicate=last.duplicate)
        env.world.call(point, str(row.id))  # between the ack and the saved position: a planned SIGKILL lands here

    relay.hook = published
    held(env)
    await relay.run()


# --- the notebook's side ---------------------------------------------------------------------------


def make_orders(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """n seeded orders, o-001 ..., over nine customers."""
    r = rng(seed, "lesson07:orders")
    return [
        {"id": f"o-{i:03d}", "customer": f"c-{r.randint(1, 9)}", "cents": r.randint(500, 20_000)}
        for i in range(1, n + 1)
    ]


async def stored(js: Any, stream: str, subject: str) -> list[tuple[str, str]]:
    """(order id, Nats-Msg-Id or '') of every message the stream holds on `subject`, in stream order."""
    info = await js.stream_info(stream)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        if msg.subject == subject:
            body = json.loads(msg.data)
            found.append((str(body.get("id")), (msg.headers or {}).get(MSG_ID, "")))
    return found


async def stored_orders(js: Any, stream: str, subject: str) -> list[dict[str, Any]]:
    """The orders (event bodies) the stream holds on `subject`, in stream order, a copy stored twice twice."""
    info = await js.stream_info(stream)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        if msg.subject == subject:
            found.append(dict(json.loads(msg.data)))
    return found


def as_payments(orders: Sequence[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """Orders as the payments consumer's messages (lesson 03's shape), one per stored event, duplicates kept:
    payment id `<tag>-<order id>` (the gateway keeps its charges across runs), the customer's account."""
    return [{"payment_id": f"{tag}-{o['id']}", "account": o["customer"], "cents": o["cents"]} for o in orders]


@dataclass
class DualWrite:
    """One dual-write run, counted from the shop's database and the stream."""

    variant: str
    orders: int
    kills: int  # checkout processes SIGKILLed between their two writes
    relay_kills: int  # relay processes SIGKILLed after an ack, before saving their position
    committed: int  # orders in the database
    published: int  # distinct orders with an event in the stream
    lost: list[str]  # committed, never published: an order nobody hears of
    phantom: list[str]  # published, never committed: an event for an order that does not exist
    twice: list[str]  # orders whose event the stream stored more than once
    seconds: float
    killed: list[str]  # the orders whose checkout was SIGKILLed between its two writes

    def row(self) -> tuple[str, int, int, int, int, int, int, int, int]:
        return (self.variant, self.orders, self.kills, self.relay_kills, self.committed, self.published,
                len(self.lost), len(self.phantom), len(self.twice))  # fmt: skip

    def table(self) -> Table:
        """This run as a one-row table (see `table(*results)` to compare runs)."""
        return table(self)

    def __repr__(self) -> str:
        relays = f", {plural(self.relay_kills, 'relay')} SIGKILLed" if self.relay_kills else ""
        return (
            f"{self.variant}: {self.orders} orders, {plural(self.kills, 'checkout')} SIGKILLed{relays}: "
            f"{self.committed} committed, "
            f"{self.published} published; {len(self.lost)} lost, {len(self.phantom)} phantom, "
            f"{len(self.twice)} stored twice ({self.seconds:.1f} s)"
        )

    def _repr_html_(self) -> str:
        return Table([self])._repr_html_()


HEADS = ("checkout", "orders", "killed", "relay killed", "committed", "published", "lost", "phantom", "stored twice")


@dataclass
class Table:
    """Dual-write runs side by side."""

    results: list[DualWrite]

    def __repr__(self) -> str:
        lines = [f"{HEADS[0]:<22}" + "".join(f"{h:>{len(h) + 3}}" for h in HEADS[1:])]
        lines += [f"{r[0]:<22}" + "".join(f"{v:>{len(h) + 3}}" for v, h in zip(r[1:], HEADS[1:], strict=True))
                  for r in (x.row() for x in self.results)]  # fmt: skip
        return "\n".join(lines)

    def __str__(self) -> str:
        return repr(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in HEADS)
        body = "".join(
            f"<tr><td><code>{r[0]}</code></td>" + "".join(f"<td>{v}</td>" for v in r[1:6])
            + "".join(f"<td><b>{v}</b></td>" for v in r[6:]) + "</tr>"
            for r in (x.row() for x in self.results)
        )  # fmt: skip
        return f"<table><tr>{head}</tr>{body}</table>"


def table(*results: DualWrite) -> Table:
    """Runs side by side (a table in a notebook, text elsewhere)."""
    return Table(list(results))


def _lab(handler: Callable[..., Any], seed: int) -> tuple[Run, str]:
    folder, path = write_handler(handler)
    lab = Run(__name__, path, seed)
    lab.sandbox = Sandbox(why_not=SANDBOX)
    return lab, folder


async def _provision(lab: Run, window: float) -> str:
    """The run's stream (with this duplicate window) and an empty shop; returns the database's path."""
    from nats.js.api import StreamConfig

    config = StreamConfig(
        name=lab.names.stream(STREAM), subjects=[lab.names.subject("orders.>")], duplicate_window=window
    )
    await lab.js.add_stream(config)
    path = os.path.join(lab.home, "shop.sqlite")
    open_store(path).close()
    return path


def _killer(lab: Run, planned: set[str]) -> Callable[[Child, str | None, dict[str, Any], int], Any]:
    """An effect handler that SIGKILLs the calling process the first time it reaches a planned key."""
    fired: set[str] = set()

    async def maybe_kill(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        if key in planned and key not in fired:
            fired.add(key)
            lab.log.record("crash", "kill", key, pid=child.pid, role=child.role)
            await child.kill("nemesis")  # the process waits for this call's answer: it never comes

    return maybe_kill


async def dual_write(
    variant: str | Callable[..., Any] = "commit_then_publish",
    *,
    orders: int = 50,
    kills: int = 5,
    relay_kills: int = 0,
    seed: int = 1,
    timeout: float = 30.0,
) -> DualWrite:
    """Place `orders` seeded orders through a checkout that dies `kills` times between its two writes; count."""
    handler = VARIANTS[variant] if isinstance(variant, str) else variant
    started = time.perf_counter()
    batch = make_orders(orders, seed)
    doomed = set(rng(seed, "lesson07:checkout kills").sample([o["id"] for o in batch], kills))
    lab, folder = _lab(handler, seed)
    try:
        async with lab:
            path = await _provision(lab, DEFAULT_WINDOW)
            params = {"handler": handler.__name__, "db_path": path, "placed": lab.names.subject(SUBJECT)}
            lab.on("between", _killer(lab, doomed))
            # The relay's kills land on outbox ids the run will have (a killed checkout's row rolls back).
            ids = range(1, max(1, orders - kills) + 1)
            relays = _Relays(lab, path, {str(i) for i in rng(seed, "lesson07:relay kills").sample(ids, relay_kills)})
            spare = asyncio.ensure_future(lab.spawn("checkout", params=params))  # the next process, started early
            checkout = await spare
            spare = asyncio.ensure_future(lab.spawn("checkout", params=params))
            try:
                for order in batch:
                    reply = await checkout.call("place", CALL_TIMEOUT, order=order)
                    if reply.gone and checkout.killed != "nemesis":
                        raise RuntimeError(f"the checkout process {checkout.how_it_ended()} placing {order['id']}")
                    if reply.gone:  # SIGKILLed as planned: the next order goes to a fresh checkout
                        checkout = await spare
                        spare = asyncio.ensure_future(lab.spawn("checkout", params=params))
                    elif not reply.ok:
                        raise RuntimeError(f"checkout of {order['id']} {reply.describe()}")
                await relays.caught_up(timeout)
            finally:
                spare.cancel()
                await relays.stop()
            events = await stored(lab.js, lab.names.stream(STREAM), lab.names.subject(SUBJECT))
            committed = order_ids(path)
            crashes = lab.log.events("crash")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_order = Counter(oid for oid, _ in events)
    return DualWrite(
        handler.__name__, orders, sum(c.role == "checkout" for c in crashes), sum(c.role == "relay" for c in crashes),
        committed=len(committed), published=len(per_order),
        lost=sorted(committed - set(per_order)), phantom=sorted(set(per_order) - committed),
        twice=sorted(oid for oid, n in per_order.items() if n > 1), seconds=time.perf_counter() - started,
        killed=sorted(str(c.key) for c in crashes if c.role == "checkout"),
    )  # fmt: skip


class _Relays:
    """Relay processes, one at a time: the next is released once the last one died (after `between()`)."""

    def __init__(self, lab: Run, path: str, planned: set[str], between: Callable[[], Any] | None = None) -> None:
        self.lab, self.path, self.between = lab, path, between
        self.spawns = HeldSpawns(lab, "relay", lambda n: [], len(planned) + 1, params={"db_path": path})
        self.current: Child | None = None
        self.failed = ""  # how a relay ended that no planned kill ended
        lab.on("published", _killer(lab, planned))
        self.spawns.prepare(min(2, len(planned) + 1))
        self.task = asyncio.ensure_future(self._keep_running())

    async def _keep_running(self) -> None:
        while (child := await self.spawns.release()) is not None:
            self.current = child
            self.spawns.prepare(1)
            await child.exited()
            if child.killed != "nemesis":
                self.failed = f"the relay process {child.how_it_ended()}: {' | '.join(child.output)[-500:]}"
                return
            if self.between is not None:
                await self.between()

    async def caught_up(self, timeout: float) -> None:
        """Return once the relay has saved every outbox row as published."""

        def done() -> bool:
            if self.failed:
                raise RuntimeError(self.failed)
            now = counts(self.path)
            return now.position >= now.last

        if not await self.lab.wait_for(done, timeout):
            raise TimeoutError(f"the relay did not publish the outbox within {timeout} s: {counts(self.path)}")

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.spawns.cancel()
        if self.current is not None:
            await self.current.kill()


# --- the relay's resend --------------------------------------------------------------------------


@dataclass
class Resend:
    """A relay killed between the stream's ack and saving its position, and what its successor's resend did."""

    window: float  # the stream's duplicate window, seconds
    rows: int
    killed_at: int  # the outbox id the first relay had acked and not saved
    down: float  # seconds between the kill and the next relay's start
    answers: list[bool]  # the PubAck's `duplicate` for each publish of that row, as the relays saw them
    copies: dict[str, int]  # Msg-Id -> messages the stream holds with it
    events: list[dict[str, Any]] = field(default_factory=list)  # the orders the stream holds, in stream order

    @property
    def resent(self) -> bool:
        """The row was published again."""
        return len(self.answers) > 1

    @property
    def stored_twice(self) -> list[str]:
        """Msg-Ids the stream holds more than once: past the stream, only the consumer can recognise these."""
        return sorted((k for k, n in self.copies.items() if n > 1), key=int)

    def __repr__(self) -> str:
        again = "published again" if self.resent else "not published again"
        told = "duplicate" if self.answers[-1:] == [True] else "new message"
        return (
            f"window {self.window:g} s, relay down {self.down:.2f} s: row {self.killed_at} {again}, the stream said "
            f"'{told}'; {sum(self.copies.values())} messages for {self.rows} rows, stored twice: "
            f"{self.stored_twice or 'none'}"
        )


async def relay_resend(
    *, window: float = DEFAULT_WINDOW, past_window: bool = False, rows: int = 5, kill_at: int = 3, timeout: float = 20.0
) -> Resend:
    """Outbox rows, a relay SIGKILLed after the stream acked row `kill_at` and before it saved it, then a new relay.

    `past_window`: the new relay starts only once the server has forgotten a Msg-Id published just after
    the kill (a probe on its own subject, asked again until the server takes it as new), so it resends
    after the window has passed. Counted from the stream; the PubAcks from what the relays reported.
    """
    lab, folder = _lab(with_outbox, kill_at)  # the harness runs a file; the relay is the course's own
    down = [0.0]
    try:
        async with lab:
            path = await _provision(lab, window)
            db = open_store(path)
            for order in make_orders(rows):
                place_order(db, order, lab.names.subject(SUBJECT))
            db.close()
            probe = lab.names.subject(PROBE)

            async def between() -> None:
                died = time.perf_counter()
                if past_window:
                    await lab.js.publish(probe, b"", headers={MSG_ID: "probe"})  # after the killed row's ack

                    async def forgotten() -> bool:
                        return not (await lab.js.publish(probe, b"", headers={MSG_ID: "probe"})).duplicate

                    if not await lab.wait_for(forgotten, window + timeout):
                        raise TimeoutError(f"the server still knew a Msg-Id after {window + timeout} s")
                down[0] = time.perf_counter() - died

            relays = _Relays(lab, path, {str(kill_at)}, between)
            try:
                await relays.caught_up(timeout)
            finally:
                await relays.stop()
            copies = Counter(
                msg_id for _, msg_id in await stored(lab.js, lab.names.stream(STREAM), lab.names.subject(SUBJECT))
            )
            events = await stored_orders(lab.js, lab.names.stream(STREAM), lab.names.subject(SUBJECT))
            answers = [bool(e.detail["duplicate"]) for e in lab.log.events("note", "acked") if e.key == str(kill_at)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Resend(window, rows, kill_at, down[0], answers, dict(copies), events)


# --- one order's path: carry and trace live in msglab.world.correlation (a grader imports no demo) ---------


# --- the charges the gateway made: the double-charge incident's count ------------------------------


def double_charged(bench: Any, payments: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Payment id -> charges, for the payments (of these) that lesson 03's gateway charged more than once,
    read from the gateway's own store."""
    from msglab.world.gateway import DEFAULT_WINDOW as KEY_WINDOW
    from msglab.world.gateway import GatewayView

    ids = {p["payment_id"] for p in payments}
    charges = Counter(
        c.reference for c in GatewayView(bench.gateway_db, "", KEY_WINDOW).charges() if c.reference in ids
    )
    return {str(pid): n for pid, n in sorted(charges.items()) if n > 1}


@dataclass(frozen=True)
class Twice:
    """One payments run's double effects, per order: charges at lesson 03's gateway (its own store) and rows in
    the shop's ledger, each only where there is more than one."""

    charged: dict[str, int]  # order id -> charges, for orders charged more than once
    credited: dict[str, int]  # order id -> ledger rows, for orders credited more than once

    def __repr__(self) -> str:
        def shown(counts: dict[str, int]) -> str:
            return ", ".join(f"{oid} ×{n}" for oid, n in counts.items()) or "none"

        return f"orders charged twice: {shown(self.charged)}; credited twice: {shown(self.credited)}"


def twice(bench: Any, payments: Sequence[dict[str, Any]]) -> Twice:
    """The orders (of these payments, `<tag>-<order id>` as `as_payments` names them) that lesson 03's gateway
    charged more than once and the shop's ledger credited more than once, read from the gateway's and the
    ledger's own records; a copy the stream stored twice is one order, counted once."""
    from msglab.world.payments import ledger_counts

    ids = sorted({str(p["payment_id"]) for p in payments})
    rows = ledger_counts(bench.db_path, ids)

    def order(pid: str) -> str:
        return pid.split("-", 1)[1]

    return Twice(
        {order(pid): n for pid, n in double_charged(bench, payments).items()},
        {order(pid): rows[pid] for pid in ids if rows[pid] > 1},
    )


async def default_duplicate_window(js: Any) -> float:
    """The duplicate window, in seconds, that this server gives a stream created without one (asked, not assumed)."""
    await js.add_stream(name=PROBE_STREAM, subjects=["lesson07.probe.>"])
    try:
        return float((await js.stream_info(PROBE_STREAM)).config.duplicate_window)
    finally:
        await js.delete_stream(PROBE_STREAM)


# --- the live pipeline: checkout in the notebook, every other service a process of its own ------------------

LIVE_STREAM = "LESSON07_ORDERS"  # lesson07.orders.>: placed, status.<id>, payments.dlq, email.dlq
PROBE_STREAM = "LESSON07_PROBE"  # a stream made only to read the server's default duplicate window
STREAMS = (STREAM, LIVE_STREAM, PROBE_STREAM)
DURABLES = ("lesson07_payments", "lesson07_email")
LIVE = "lesson07.orders"
GATEWAY = "lesson07.gateway"  # outside the stream's subjects: a charge request stored by the stream gets its PubAck
PROVIDER = "lesson07.provider"  # module 04's email provider
DOMAIN = "example.com"  # receipts go to <customer>@example.com
# Seconds before a delivery nobody acked comes back (scaled down: production waits 30 s or more). Payments' is
# short, so a SIGKILLed payments' order comes back within the lesson's second; email's leaves a slow send room.
ACK_WAIT = {"payments": 1.0, "email": 5.0}
HELD = "lesson07.held"  # where a payments process that holds after a charge says so (core NATS, not stored)
POLL = 0.02  # seconds between two readings of the consumers while settled() waits on them (a poll of the server)
SERVICES = ("relay", "payments", "email", "status", "gateway", "provider")


def checkout(db: Any, order: dict[str, Any], prefix: str = LIVE) -> None:
    """Checkout's one transaction: the order, its `placed` event and its `pending` status, both in the outbox,
    both carrying a Correlation-Id it starts (the order id)."""
    headers = json.dumps(carry(start=order["id"]))
    status = json.dumps({"id": order["id"], "status": "pending", "customer": order["customer"]}).encode()
    with db:
        db.execute(INSERT_ORDER, order)
        for subject, payload in ((f"{prefix}.placed", event(order)), (f"{prefix}.status.{order['id']}", status)):
            db.execute(INSERT_OUTBOX, {"id": order["id"], "subject": subject, "payload": payload, "headers": headers})


@dataclass(frozen=True)
class Lag:
    """One reading of every consumer: when, each durable's (depth, queue age s, status), each DLQ's depth."""

    t: float
    consumers: dict[str, tuple[int, float, str]]
    dlqs: dict[str, int]

    @property
    def dlq(self) -> int:
        """Messages waiting in every DLQ (payments' and email's)."""
        return sum(self.dlqs.values())

    def __repr__(self) -> str:
        cells = "  ".join(
            f"{name}: {d:>2} deep, {age:5.2f} s old, {st:<7}" for name, (d, age, st) in self.consumers.items()
        )
        return f"{cells}  DLQ: " + ", ".join(f"{name} {n}" for name, n in self.dlqs.items())


@dataclass(frozen=True)
class Link:
    """A URL shown as a clickable link in a notebook (and as the plain URL elsewhere)."""

    url: str

    def __repr__(self) -> str:
        return self.url

    def _repr_html_(self) -> str:
        from html import escape

        shown = escape(self.url)
        return f'<a href="{shown}" target="_blank">{shown}</a> (the status page; it opens in a new tab)'


def link(url: str) -> Link:
    """Show `url` as a link a learner can click."""
    return Link(url)


@dataclass(frozen=True)
class Shown:
    """One change the status page pushed to its browsers: the order, its new status, when this kernel got it."""

    order_id: str
    status: str
    ts: float


class PageView:
    """The status page (a process of its own) as a browser sees it: its URL, what it shows now, and every change
    it pushed (server-sent events, GET /events), each stamped when this kernel received it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.orders: dict[str, str] = {}
        self.changes: list[Shown] = []
        self._session: Any = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, url: str) -> PageView:
        """Connect to the page's event stream; every change from now on is seen (the page sends its state first)."""
        import aiohttp

        view = cls(url)
        view._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=CALL_TIMEOUT))
        try:
            response = await view._session.get(url + "events")
            response.raise_for_status()
        except BaseException:
            await view._session.close()
            raise
        view._task = asyncio.ensure_future(view._read(response))
        return view

    async def _read(self, response: Any) -> None:
        import aiohttp

        data = ""
        try:
            async for raw in response.content:  # one line at a time
                line = raw.decode().rstrip("\r\n")
                if line.startswith("data:"):
                    data = line.removeprefix("data:").strip()
                elif not line and data:  # an event ends with a blank line
                    body, data = json.loads(data), ""
                    self.orders[str(body["id"])] = str(body["status"])
                    self.changes.append(Shown(str(body["id"]), str(body["status"]), time.time()))
        except (TimeoutError, ConnectionError, ValueError, aiohttp.ClientError):
            return  # the page went away (or sent what is not an event): what it showed so far stays

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def __repr__(self) -> str:
        return f"<status page {self.url}: {len(self.orders)} orders shown>"


@dataclass(frozen=True)
class Receipts:
    """What module 04's email provider did for the shop's receipts, from its own records, and email's DLQ."""

    sent: dict[str, str]  # order id -> template of the one receipt sent
    refused: dict[int, int]  # status -> requests the provider refused with it (0: a dropped connection)
    dead: list[str]  # orders whose receipt email dead-lettered
    requests: int

    def __repr__(self) -> str:
        kinds = Counter(self.sent.values())
        refused = ", ".join(f"{n} × {status}" for status, n in sorted(self.refused.items())) or "none"
        return (
            f"{len(self.sent)} receipts sent ({', '.join(f'{n} {t}' for t, n in sorted(kinds.items()))}) "
            f"in {self.requests} requests; refused: {refused}; dead-lettered: {', '.join(self.dead) or 'none'}"
        )


def _url(nc: Any) -> str:
    """The URL `nc` connected to (credentials included, as given): the shop's processes connect there too."""
    connected = nc.connected_url
    if connected is None:
        raise RuntimeError("the connection is closed: connect first")
    return str(connected.geturl())


def start_relay(url: str, db_path: str, *, poll: float = 0.02) -> Service:
    """The course's relay (msglab.world.relay) on the shop's database, as a process of its own (shop_services)."""
    from msglab.world import shop_services

    return shop_services.start("relay", url, db_path=db_path, poll=poll)


@dataclass(frozen=True)
class Crash:
    """A payments process SIGKILLed after the gateway charged an order and before it acked the order's event,
    and what the gateway recorded once a new payments process took the redelivery."""

    order_id: str
    pid: int  # the payments process SIGKILLed
    charged_before_kill: int  # charges for the order when it died
    requests: int  # charge requests for the order the gateway received
    charges: int  # charges the gateway made for it
    replayed: int  # requests answered with the first charge (the same idempotency key)
    status: str  # what the page shows for the order at the end

    def __repr__(self) -> str:
        return (
            f"{self.order_id}: payments (pid {self.pid}) SIGKILLed after {plural(self.charged_before_kill, 'charge')}, "
            f"before its ack; a new payments process took the redelivery. The gateway: "
            f"{plural(self.requests, 'charge request')}, {plural(self.charges, 'charge')}, {self.replayed} replayed; "
            f"the page shows {self.status}"
        )


class Shop:
    """Lesson 07's pipeline, live: checkout (in the notebook) writes the outbox; the course's relay, payments
    (module 03's idempotent charge at the course's gateway), email (module 04's retries and DLQ through its email
    provider), the status page, the gateway and the provider each run as a process of their own, and each hop
    carries the order's Correlation-Id. `await shop.page()` is the page as a browser sees it."""

    def __init__(self, nc: Any, js: Any, url: str, folder: str) -> None:
        self.nc, self.js, self.url, self.folder = nc, js, url, folder
        self.path = os.path.join(folder, "shop.sqlite")
        self.db = open_store(self.path)
        self.lags: list[Lag] = []
        self.budget = 2.0  # seconds of queue age this shop promises (scaled down from minutes)
        self.services: dict[str, Any] = {}  # name -> its running process (pid, alive, stop())
        self.stalled = False
        self._page: PageView | None = None

    @property
    def gateway(self) -> Any:
        """The gateway process (msglab.world.gateway.Gateway): `.charges()`, `.requests()` read its store."""
        return self.services["gateway"]

    @property
    def provider(self) -> Any:
        """Module 04's email provider process (msglab.world.email_provider.Provider): `.outage()`, `.control()`,
        `.sent()`, `.requests()`."""
        return self.services["provider"]

    @classmethod
    async def open(cls, nc: Any, js: Any, url: str | None = None) -> Shop:
        """The stream and its durables, the shop's database, then the six processes, started at once."""
        import tempfile

        from nats.js.api import AckPolicy, ConsumerConfig

        from msglab.broker import delete_streams

        await delete_streams(js, "LESSON07_")  # an interrupted run's leftovers
        await js.add_stream(name=LIVE_STREAM, subjects=[f"{LIVE}.>"], duplicate_window=DEFAULT_WINDOW)
        for durable, subject, budget in ((DURABLES[0], f"{LIVE}.placed", None), (DURABLES[1], f"{LIVE}.status.*", 5)):
            wait = ACK_WAIT[durable.removeprefix("lesson07_")]
            config = ConsumerConfig(
                durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=wait,
                max_deliver=budget,
            )  # fmt: skip
            await js.add_consumer(LIVE_STREAM, config)
        shop = cls(nc, js, url or _url(nc), tempfile.mkdtemp(prefix="msglab-lesson07-"))
        try:
            starting = {name: asyncio.to_thread(shop._start, name) for name in SERVICES}
            started = await asyncio.gather(*starting.values(), return_exceptions=True)
            failed = [s for s in started if isinstance(s, BaseException)]
            shop.services = {n: s for n, s in zip(starting, started, strict=True) if not isinstance(s, BaseException)}
            if failed:
                raise failed[0]
            # Module 04's provider knows the confirmation template; the shop's other receipt is added, as a deploy does.
            await shop.provider.control(nc, "template", name=TEMPLATES["failed"], known=True)
            shop._page = await PageView.open(shop.services["status"].url)
        except BaseException:
            await shop.close()
            raise
        return shop

    def _start(self, name: str, **extra: Any) -> Any:
        """Start one of the shop's processes (blocking until it serves: run it in a thread)."""
        from msglab.world import email_provider, gateway, shop_services

        if name == "relay":
            return start_relay(self.url, self.path)
        if name == "gateway":
            return gateway.start(
                self.url,
                db_path=os.path.join(self.folder, "gateway.sqlite"),
                prefix=GATEWAY,
                ready_timeout=READY_TIMEOUT,
            )
        if name == "provider":
            return email_provider.start(self.url, prefix=PROVIDER, ready_timeout=READY_TIMEOUT)
        options: dict[str, dict[str, Any]] = {
            "payments": {
                "stream": LIVE_STREAM, "durable": DURABLES[0], "gateway": f"{GATEWAY}.charge",
                "status": f"{LIVE}.status", "dlq": f"{LIVE}.payments.dlq", "key": "order", "card_limit": CARD_LIMIT,
            },
            "email": {
                "stream": LIVE_STREAM, "durable": DURABLES[1], "provider": f"{PROVIDER}.send",
                "dlq": f"{LIVE}.email.dlq", "domain": DOMAIN,
            },
            "status": {"subject": f"{LIVE}.status.>", "stream": LIVE_STREAM},
        }  # fmt: skip
        return shop_services.start(name, self.url, **options[name], **extra)

    def __repr__(self) -> str:
        names = {"status": "status page", "provider": "email provider"}
        running = ", ".join(
            f"{names.get(name, name)} {s.pid}" + ("" if s.alive else " (stopped)") for name, s in self.services.items()
        )
        return f"<Shop: processes {running}>"

    async def page(self) -> PageView:
        """The status page as a browser sees it (`page.url` to open it, `page.orders`, `page.changes`)."""
        if self._page is None:
            self._page = await PageView.open(self.services["status"].url)
        return self._page

    async def place(self, orders: Sequence[dict[str, Any]]) -> list[str]:
        """Checkout places each order (one transaction each); the relay publishes them as it finds them."""
        for order in orders:
            checkout(self.db, order)
        return [str(o["id"]) for o in orders]

    def stall(self) -> None:
        """Payments stops taking orders (a stuck deploy): its process is stopped, and orders wait in its durable."""
        if not self.stalled:
            self.services["payments"].stop()
            self.stalled = True

    def release(self) -> None:
        """A new payments process takes the orders that waited."""
        if self.stalled:
            self.services["payments"] = self._start("payments")
            self.stalled = False

    async def crash_payments(self, order: dict[str, Any]) -> Crash:
        """Replace payments by a process that holds after its first charge, place `order`, SIGKILL that process
        once it has charged the order and not acked it, start a new payments process, and wait until the order
        settles; counted from the gateway's own records."""
        from msglab.broker import settle_subscriptions

        said: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_held(msg: Any) -> None:
            said.put_nowait(json.loads(msg.data))

        sub = await self.nc.subscribe(HELD, cb=on_held)
        await settle_subscriptions(self.nc)
        try:
            await asyncio.to_thread(self.stall)  # the running payments is idle: stopped, nothing of its lost
            held = await asyncio.to_thread(self._start, "payments", hold_after=1, announce=HELD)
            self.services["payments"], self.stalled = held, False
            await self.place([order])
            holding = await asyncio.wait_for(said.get(), CALL_TIMEOUT)  # charged, not acked: it waits there
            before = len(await asyncio.to_thread(self.gateway.charges, order["id"]))
            await asyncio.to_thread(held.kill)
            self.services["payments"] = await asyncio.to_thread(self._start, "payments")
            final = await self.settled([order["id"]])  # the redelivery comes after the ack wait
        finally:
            await sub.unsubscribe()
        asked = [r for r in await asyncio.to_thread(self.gateway.requests) if r.reference == order["id"]]
        charges = await asyncio.to_thread(self.gateway.charges, order["id"])
        replayed = sum(r.replayed for r in asked)
        return Crash(
            str(order["id"]), int(holding["pid"]), before, len(asked), len(charges), replayed, final[order["id"]]
        )

    async def lag(self) -> Lag:
        """Read every consumer's depth and queue age now, and its status over the readings so far (lesson 05's
        rule: ERROR at the budget, WARNING when the age grows at least half as fast as the clock)."""
        from msglab.world.fulfilment import depth_and_age, status

        now, seen = time.time(), {}
        for durable, subject in ((DURABLES[0], f"{LIVE}.placed"), (DURABLES[1], f"{LIVE}.status.*")):
            depth, age = await depth_and_age(self.js, LIVE_STREAM, durable, subject)
            name = durable.removeprefix("lesson07_")
            history = [(x.t, x.consumers[name][1]) for x in self.lags[-5:]] + [(now, age)]
            seen[name] = (depth, age, status(history, self.budget))
        lag = Lag(now, seen, await self.dlqs())
        self.lags.append(lag)
        return lag

    async def dlqs(self) -> dict[str, int]:
        """Messages waiting in each DLQ: payments' (orders it refused for good), email's (receipts never sent)."""
        info = await self.js.stream_info(LIVE_STREAM, subjects_filter=f"{LIVE}.*.dlq")
        held = info.state.subjects or {}
        return {name: int(held.get(f"{LIVE}.{name}.dlq", 0)) for name in ("payments", "email")}

    async def dlq_depth(self) -> int:
        """Messages waiting in both DLQs."""
        return sum((await self.dlqs()).values())

    async def watch(self, orders: Sequence[dict[str, Any]]) -> list[Lag]:
        """Place the orders one by one; once the stream has stored each order's event, print a reading."""
        from msglab.broker import settle_subscriptions

        stored_now: asyncio.Queue[str] = asyncio.Queue()

        async def on_placed(msg: Any) -> None:
            stored_now.put_nowait(json.loads(msg.data)["id"])

        sub = await self.nc.subscribe(f"{LIVE}.placed", cb=on_placed)
        await settle_subscriptions(self.nc)
        readings = []
        try:
            for order in orders:
                await self.place([order])
                async with asyncio.timeout(CALL_TIMEOUT):
                    while await stored_now.get() != order["id"]:
                        pass
                    # The copy a core subscription gets can come before the stream has stored the message (a
                    # loaded run read depth 0 for the first order): wait until the stream's last event is this one.
                    while await self._last_placed() != order["id"]:  # noqa: ASYNC110 (a poll of the server, bounded)
                        await asyncio.sleep(0.005)
                readings.append(await self.lag())
                print(f"{order['id']} stored  {readings[-1]}")
        finally:
            await sub.unsubscribe()
        return readings

    async def _last_placed(self) -> str | None:
        """The order id of the last `placed` event the stream has stored (None before the first)."""
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(LIVE_STREAM, f"{LIVE}.placed")
        except NotFoundError:
            return None
        return str(json.loads(msg.data)["id"])

    def _stopped(self) -> list[str]:
        """The shop's processes that ended without being told to (a stalled payments was told)."""
        return [
            f"the {name} process (pid {s.pid}) stopped, exit code {s.proc.returncode}"
            for name, s in self.services.items()
            if not s.alive and not (name == "payments" and self.stalled)
        ]

    async def _busy(self) -> dict[str, int]:
        """Each durable's depth (events not yet acked or dead-lettered), read from the server."""
        depth = {}
        for durable in DURABLES:
            info = await self.js.consumer_info(LIVE_STREAM, durable)
            depth[durable.removeprefix("lesson07_")] = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        return depth

    async def settled(self, ids: Sequence[str], timeout: float = CALL_TIMEOUT) -> dict[str, str]:
        """Wait until the page shows each order's final status and payments and email have finished every event
        stored (acked, or dead-lettered); return what the page shows. A process of the shop that stopped on its
        own is named at once, rather than waited out."""
        from msglab.world.status_page import FINAL

        page = await self.page()
        if self.stalled:
            raise RuntimeError("payments is stalled: release() it first")
        busy: dict[str, int] = {}
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if stopped := self._stopped():
                        raise RuntimeError("; ".join(stopped))
                    if all(page.orders.get(oid) in FINAL for oid in ids):
                        busy = await self._busy()
                        if not any(busy.values()):
                            return {oid: page.orders[oid] for oid in ids}
                    await asyncio.sleep(POLL)  # a poll of the page's pushes and the server, bounded
        except TimeoutError:
            waiting = {oid: page.orders.get(oid, "not shown") for oid in ids if page.orders.get(oid) not in FINAL}
            raise TimeoutError(f"not settled within {timeout:g} s: the page shows {waiting or 'all final'}; "
                               f"events not yet acked: {busy or 'not read'}") from None  # fmt: skip

    async def receipts(self) -> Receipts:
        """The receipts module 04's provider sent and refused (its own records) and those email dead-lettered."""
        from nats.js.errors import NotFoundError

        sent = {str(e.order_id): e.template for e in await asyncio.to_thread(self.provider.sent)}
        asked = await asyncio.to_thread(self.provider.requests)
        refused = Counter(r.status for r in asked if r.status != 200)
        dead, seq = [], 1
        while True:
            try:
                msg = await self.js.get_msg(LIVE_STREAM, seq, subject=f"{LIVE}.email.dlq", next=True)
            except NotFoundError:
                break
            dead.append(str(json.loads(msg.data)["id"]))
            seq = int(msg.seq or seq) + 1
        return Receipts(sent, dict(refused), dead, len(asked))

    async def trace(self, order_id: str) -> Trace:
        """One order's path by its Correlation-Id (the order id, as checkout starts it): every event the stream
        stored with it (stamped by the server; who published it, read from its Nats-Msg-Id), each change the page
        pushed for the order, each charge request the gateway recorded (an outside API that never sees our headers:
        found by the order id the request names) and each request for its receipt that the email provider recorded
        with this Correlation-Id."""
        hops = []
        info = await self.js.stream_info(LIVE_STREAM)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await self.js.get_msg(LIVE_STREAM, seq)
            if (msg.headers or {}).get(CORRELATION_ID) != order_id:
                continue
            what = str(msg.subject).removeprefix(f"{LIVE}.")
            if what.startswith("status."):
                what = f"status {json.loads(msg.data or b'{}').get('status')}"
            msg_id = (msg.headers or {}).get(MSG_ID, "")
            by = "relay" if msg_id.isdigit() else "email" if what == "email.dlq" else "payments"
            hops.append(Hop(msg.time.timestamp(), f"{by}, {LIVE_STREAM} #{seq}", what))
        if self._page is not None:
            shown = [c for c in self._page.changes if c.order_id == order_id]
            hops += [Hop(c.ts, "status page", f"shown {c.status}") for c in shown]
        for g in await asyncio.to_thread(self.gateway.requests):  # the gateway's records name the order (reference)
            if g.reference == order_id:
                what = (
                    "charge replayed" if g.replayed else "charged" if g.outcome == "charged" else f"charge: {g.outcome}"
                )
                hops.append(Hop(g.ts, "gateway", what))
        for r in await asyncio.to_thread(self.provider.requests):  # the provider keeps each request's Correlation-Id
            if r.correlation_id != order_id:
                continue
            what = f"receipt sent ({r.template})" if r.status == 200 else f"receipt refused: {r.status}"
            hops.append(Hop(r.ts, "email provider", what))
        return Trace(order_id, sorted(hops, key=lambda hop: hop.ts))

    async def close(self) -> None:
        """Stop every process the shop started and the page's reader, delete the stream, remove the databases."""
        from msglab.broker import delete_streams

        if self._page is not None:
            await self._page.close()
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in self.services.values()))
        self.db.close()
        await delete_streams(self.js, "LESSON07_")
        shutil.rmtree(self.folder, ignore_errors=True)
