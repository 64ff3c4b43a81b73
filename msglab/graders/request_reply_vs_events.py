"""Lab 01 grader: an order service that asks only what it must, and announces the rest.

The shop (played by the grader, out of the learner's reach): an inventory service that answers
stock reservations on `inventory.reserve`, a loyalty service that answers on `loyalty.award` and
also reads every `orders.placed` event from its durable 'loyalty', the stream ORDERS with the
durables 'email' and 'loyalty' (two Topology objects on one stream). The learner's file is the
order service (`place_order`, run in two service processes) and the email service
(`email_worker`, three incarnations, started ahead of their turn and held until released).

Workload (seeded), 12 orders, each with a sku of its own, in phases:
  1. every service up: o-1; then o-2 while the loyalty service ignores the request about it
     (silent); then two more, one at a time (each emailed before the next, so the crash falls on
     the same order on every replay). Email worker #1 is SIGKILLed at its email #3 or #4 (before
     or after the email goes out);
  2. email down (#1 dead, #2 not released): three more orders;
  the order the inventory has no stock for, and the order placed while the stream refuses every
     publish (full, discard-new), are slotted into 1-2 at seeded places;
  3. inventory down (nobody subscribed): one order; it must be refused at once;
  4. email worker #2 is released and SIGKILLed at its email #2 or #3 (the other of before/after);
     meanwhile the second service process places one order the inventory never answers
     (silent): refused with InventoryUnavailable, after env.request_timeout and not before;
  5. email worker #3 is released and catches up, while the email provider refuses its first
     OUTAGE_CALLS env.send_email calls (ConnectionError, nothing sent; a planned fault); once the
     durable is drained and #3 has asked again after an empty fetch (seen on the broker), a late
     order: #3 itself must email it.

Invariants judged on the effect log, the stream, the consumers and the acks the broker saw:
an order is accepted exactly when stock was confirmed and the stream stored its event, whatever
email and loyalty do; refusals name the cause (OutOfStock, InventoryUnavailable) and come at the
right time; refused orders are never announced; every accepted order is emailed and reaches
loyalty exactly once; an extra email only where rule 6 allows it (`rules.allowance`: a worker
that emailed it ended before the broker had its ack, and had not gone on to an order placed after
that email); every email the provider refused goes out later and the worker lives on
(`survives_email_outage`, the step lesson 01 does not show); the durable 'email' ends drained
(`all_acked`); the running worker survives a quiet spell (`survives_idle`, rule 2). Rules 1 and 3
(`faults_fired`, `no_unplanned_deaths`) are the platform's, added by grade.py.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msglab.grading import rules
from msglab.grading.labkit import LabEnv
from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import BrokerWatch, refuse_publishes
from msglab.grading.rules import an, plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, Trace, held
from msglab.grading.verdict import Check
from msglab.world.storefront import INVENTORY, LOYALTY_ASK, Storefront, order_id

if TYPE_CHECKING:  # the learner's processes import this module too: they need none of the grader's side
    from msglab.grading.harness import Child, Reply, Run

SUBJECT = "orders.placed"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more, a lab cannot wait that long
# The platform team's part: one stream, and a durable on orders.placed for each reacting service.
EMAIL_TOPOLOGY = Topology("ORDERS", "orders.>", "email", SUBJECT, ACK_WAIT)
LOYALTY_TOPOLOGY = Topology("ORDERS", "orders.>", "loyalty", SUBJECT, ACK_WAIT)
STREAM, DURABLES = EMAIL_TOPOLOGY.stream, (EMAIL_TOPOLOGY.durable, LOYALTY_TOPOLOGY.durable)
EMAIL, LOYALTY = DURABLES
# What the learner's code may do besides the JetStream API on ORDERS (msglab.broker.users): publish and
# read its own subjects (the order events, and those an email service of its own answers on, as the
# starter's does), and ask the course's inventory and loyalty, never answer for them.
LEARNER_SUBJECTS = ["orders.>", "email.>", "emails.>"]
LEARNER_REQUESTS = [INVENTORY, LOYALTY_ASK]
REQUEST_TIMEOUT = 0.8  # env.request_timeout: not nats-py's default (0.5 s), so a missing timeout shows
SILENT_MIN = REQUEST_TIMEOUT - 0.01  # giving up on a silent inventory sooner than this ignores the timeout
# Waiting far longer than env.request_timeout: a timeout of its own. Asking twice is judged by the requests the
# inventory received, not by the time: a loaded machine stretched one 0.8 s request to 1.66 s.
SILENT_MAX = 3 * REQUEST_TIMEOUT
DOWN_MAX = REQUEST_TIMEOUT + 1.0  # nobody listening is known at once; generous for a busy machine
ACCEPT_MAX = 1.5  # an accepted order must not take longer than this (generous: it takes milliseconds)
WAITED_ON_LOYALTY = 0.3  # returning this long after loyalty got its request is waiting for loyalty
CALL_DEADLINE = 3.0  # after this the grader declares a call hung and stops the process
MAX_HUNG = 2  # after this many hung calls the grader places no more orders (each costs CALL_DEADLINE)
SERIAL_WAIT = 1.0  # the most the grader waits for email worker #1 to email an order before the next
W1_SETTLE = 1.0  # the most the first order waits for email worker #1 to show it runs
CRASH_DEADLINE = 2.5  # a worker that has not reached its planned crash by then is stopped
CATCH_UP = 4.0  # how long the last worker has to drain the durable
FIRST_PULL = 1.5  # after the drain, the worker must ask the broker again within this
IDLE_MARGIN = 1.0  # ... and ask once more within its own fetch expiry plus this
IDLE_CAP = 7.0  # the longest the grader waits for idle survival at all (nats-py's default fetch: 5 s)
LATE_DEADLINE = 2.0  # the late order must be emailed within this
SETTLE = 2.0  # at the end, how long email and loyalty have to finish
STORE_WAIT = 1.0  # around the refused publishes: how long the grader waits for a publish (it takes milliseconds)
TRACE_LINES = 16  # steps quoted per order in a verdict
OUTAGE_WORKER = 2  # the email provider is down for email worker #3 (0-based), which no crash is planned for
OUTAGE_CALLS = 2  # ... for its first this many env.send_email calls: retrying once is not enough
OUTAGE_ERROR = "ConnectionError"  # what env.send_email raises then; nothing went out
PARAMS = {"request_timeout": REQUEST_TIMEOUT}  # what env carries besides connections and names

ORDERS_AT_ONCE = ["base", "loyalty_silent"]  # the first two, always, email up
MIDDLE = ["normal", "normal", "WAIT", "normal", "normal", "normal"]  # WAIT: email worker #1 crashes
EXTRAS = ["out_of_stock", "stream_refused"]  # slotted into MIDDLE at seeded places
ROLE_WORDS = {
    "base": "placed while every service ran",
    "loyalty_silent": "placed while the loyalty service was silent",
    "normal": "placed, with stock",
    "out_of_stock": "placed with no stock for its sku",
    "stream_refused": "placed while the stream refused every publish",
    "inventory_down": "placed while nobody listened for inventory",
    "inventory_silent": "placed while the inventory service was silent",
    "late": "placed late, after a quiet spell",
}
WHERE = {"before": "before the email went out", "after": "right after the email"}  # a crash, in the lab's words


# --- what runs inside the learner's processes ------------------------------------------------


def _add_effects(env: Any) -> None:
    """Give env the lab's side effects; send_email is a crash point for the nemesis."""

    def send_email(order_id: str) -> None:
        env.world.call("send_email", str(order_id))

    def save_order(order: dict[str, Any]) -> None:
        env.world.call("save_order", str(order.get("id")) if isinstance(order, dict) else str(order))

    env.send_email = send_email
    env.save_order = save_order


def ops_orders(env: LabEnv, learner: Any) -> dict[str, Any]:
    """The order service: the grader calls place_order one order at a time."""
    from msglab.grading.runner import describe

    _add_effects(env)
    source = os.environ.get("MSGLAB_SOURCE", "")
    out_of_stock = getattr(learner, "OutOfStock", None)
    unavailable = getattr(learner, "InventoryUnavailable", None)

    def kind(exc: Exception) -> str:
        if isinstance(out_of_stock, type) and isinstance(exc, out_of_stock):
            return "out_of_stock"
        if isinstance(unavailable, type) and isinstance(exc, unavailable):
            return "inventory_unavailable"
        return "other"

    async def place_order(order: dict[str, Any]) -> dict[str, Any]:
        try:
            await learner.place_order(env, order)
        except Exception as exc:  # a refusal, or a bug: the grader judges which
            return {"accepted": False, "kind": kind(exc), **describe(exc, source)}
        return {"accepted": True}

    return {"place_order": place_order}


async def role_email_worker(env: LabEnv, learner: Any) -> None:
    """One incarnation of the email worker: waits held for its turn, then runs until it is killed."""
    _add_effects(env)
    held(env)
    await learner.email_worker(env)


# --- the lab notebook's playground --------------------------------------------------------------


async def _provision(js: Any, names: Any) -> None:
    """The stream and both durables, before any service starts (grader and playground alike)."""
    for topology in (EMAIL_TOPOLOGY, LOYALTY_TOPOLOGY):
        await topology.provision(js, names)


async def playground(env: Any) -> None:
    """For the lab notebook: the stream and durables, inventory and loyalty, and effects that print.

    The inventory has no stock for sku-0; `env.set_service(name, state)` takes a service up, down
    or silent ("email_provider" up or down: env.send_email then raises ConnectionError);
    `env.shop.awarded` lists loyalty's points so far.
    """
    await _provision(env.js, env.names)

    def record(kind: str, name: str, oid: str | None, **detail: Any) -> None:
        if name == "award_points" and detail.get("via") == "request":
            print(f"loyalty: points awarded for {oid} (asked by request)")

    shop = Storefront(env.nc, env.js, env.names, record, stream=STREAM, durable=LOYALTY, no_stock={"sku-0"})
    await shop.start()
    env.shop = shop
    provider_up = [True]

    async def set_service(name: str, state: str) -> None:
        if name == "email_provider":
            provider_up[0] = state == "up"
        else:
            await shop.set(name, state)

    def send_email(order_id: str) -> None:
        if not provider_up[0]:
            raise ConnectionError(
                f"the email provider is unavailable (connection refused): no email went out for {order_id}"
            )
        print(f"email sent for {order_id}")

    env.set_service = set_service
    env.save_order = lambda order: print(f"saved order {order['id']}")
    env.send_email = send_email


# --- the plan ------------------------------------------------------------------------------------


@dataclass
class Order:
    """One order the grader places, and what became of it."""

    id: str
    sku: str
    qty: int
    role: str
    service: str = "A"  # which order-service process places it
    started: float = 0.0  # grader clock
    ended: float = 0.0
    reply: Reply | None = None
    email_state: str = "up"  # the email worker, when the call started
    skipped: bool = False  # never placed: place_order had hung too often before

    @property
    def body(self) -> dict[str, Any]:
        return {"id": self.id, "sku": self.sku, "qty": self.qty}

    @property
    def value(self) -> dict[str, Any]:
        return self.reply.value if self.reply and self.reply.ok and isinstance(self.reply.value, dict) else {}

    @property
    def accepted(self) -> bool:
        return bool(self.value.get("accepted"))

    @property
    def kind(self) -> str:
        """How it was refused: out_of_stock, inventory_unavailable, other, hung, gone; '' if accepted."""
        if self.accepted:
            return ""
        if self.skipped:
            return "skipped"
        if self.reply is None or self.reply.gone:
            return "gone"
        if self.reply.hung:
            return "hung"
        return str(self.value.get("kind", "other"))

    @property
    def elapsed(self) -> float:
        return self.reply.elapsed if self.reply else 0.0

    def outcome(self) -> str:
        """What place_order did, in one phrase."""
        if self.skipped:
            return f"was never called: place_order had hung on {MAX_HUNG} earlier orders, so the grader placed no more"
        if self.reply is None:
            return "was never called"
        if self.reply.hung:
            return f"did not return within {CALL_DEADLINE:.0f} s (the grader stopped it)"
        if self.reply.gone:
            return "could not complete: the order-service process died"
        if self.accepted:
            return f"returned normally (accepted) after {self.elapsed:.3f} s"
        value = self.value
        where = f" at {value['where']}" if value.get("where") else ""
        return f"raised {value.get('error')}({value.get('message', '')}){where} after {self.elapsed:.3f} s"


@dataclass
class Plan:
    """The seeded run: the orders in placement order, and the two crashes of the email worker."""

    orders: list[Order]
    middle: list[str]  # order ids and "WAIT", in placement order
    crashes: list[Crash]  # for email worker #1 and #2

    @classmethod
    def draw(cls, seed: int) -> Plan:
        slots = list(MIDDLE)
        places = rng(seed, "slots")
        for extra in EXTRAS:
            slots.insert(places.randint(0, len(slots)), extra)
        roles = [*ORDERS_AT_ONCE, *slots, "inventory_down", "inventory_silent", "late"]
        goods = rng(seed, "skus")
        skus = goods.sample(range(100, 1000), len(roles))
        orders: list[Order] = []
        middle: list[str] = []
        for role, sku in zip(roles, skus, strict=True):
            if role == "WAIT":
                middle.append(role)
                continue
            order = Order(f"o-{len(orders) + 1}", f"sku-{sku}", goods.randint(1, 3), role)
            order.service = "B" if role == "inventory_silent" else "A"
            orders.append(order)
            if role not in (*ORDERS_AT_ONCE, "inventory_down", "inventory_silent", "late"):
                middle.append(order.id)
        kinds = ["before", "after"]
        crash = rng(seed, "crash")
        crash.shuffle(kinds)
        # Worker #2 meets a backlog: killed at its 2nd or 3rd email, it has emailed one event of the backlog before the
        # one it dies on, whatever the machine's pace (worker #1's orders come one at a time, with quiet moments).
        crashes = [_crash(crash.randint(3, 4), kinds[0]), _crash(crash.randint(2, 3), kinds[1])]
        return cls(orders, middle, crashes)

    def faults(self, incarnation: int) -> list[Crash]:
        """The crash plan of email worker #incarnation+1 (the third has none)."""
        return self.crashes[incarnation : incarnation + 1]

    def by_role(self, role: str) -> list[Order]:
        return [o for o in self.orders if o.role == role]

    def one(self, role: str) -> Order:
        return self.by_role(role)[0]

    def get(self, oid: str) -> Order:
        return next(o for o in self.orders if o.id == oid)


def _crash(call: int, when: str) -> Crash:
    return Crash(
        "send_email",
        call,
        when,
        point=f"{WHERE[when]} on its env.send_email call #{call}",
        counted="env.send_email call",
        hint="every event your email worker takes must go to env.send_email, one call per event, while the process"
        " keeps running",
    )


# --- the course's services, played by the grader -------------------------------------------------


def _storefront(run: Run, plan: Plan) -> Storefront:
    """The course's inventory and loyalty, with this run's silent and out-of-stock orders; evidence in the log."""

    def record(kind: str, name: str, oid: str | None, **detail: Any) -> None:
        run.log.record(kind, name, oid, role="inventory" if name.startswith("inventory") else "loyalty", **detail)

    return Storefront(
        run.nc, run.js, run.names, record, stream=STREAM, durable=LOYALTY,
        no_stock={o.sku for o in plan.by_role("out_of_stock")},
        silent_skus={o.sku for o in plan.by_role("inventory_silent")},
        silent_ids={o.id for o in plan.by_role("loyalty_silent")},
        ids_by_sku={o.sku: o.id for o in plan.orders},
    )  # fmt: skip


class Provider:
    """The email provider behind env.send_email: down for email worker #3's first OUTAGE_CALLS calls.

    A refused call raises ConnectionError in the worker and sends nothing (a note in the log, never an
    email). The outage is a planned fault (rule 1): it fired once a call was refused.
    """

    def __init__(self, run: Run, email: HeldSpawns) -> None:
        self.run, self.email = run, email
        self.refused: list[Any] = []  # the log's notes, one per refused call
        self.planned = rules.Planned(
            what=f"make the email provider refuse email worker #3's first {OUTAGE_CALLS} env.send_email calls",
            hint="email worker #3 must take the events left on the durable and send each one's email with"
            " env.send_email",
        )
        run.planned.append(self.planned)

    @property
    def worker(self) -> Child | None:
        released = self.email.released
        return released[OUTAGE_WORKER] if len(released) > OUTAGE_WORKER else None

    async def send_email(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        """The effect handler: refuse the outage's calls, record every other email as sent."""
        from msglab.grading.harness import Refuse

        if child is self.worker and 1 <= call <= OUTAGE_CALLS:
            self.refused.append(self.run.log.record("note", "email_refused", key, pid=child.pid, call=call))
            self.planned.fired = True
            said = f"the email provider is unavailable (connection refused): no email went out for {key}"
            raise Refuse(OUTAGE_ERROR, said)
        self.run.record_effect(child, "send_email", key, call=call, **detail)

    def refused_ids(self) -> list[str]:
        return list(dict.fromkeys(str(e.key) for e in self.refused))


class Stream:
    """The stream ORDERS as the grader reads it: which events it holds, and for which orders."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.events: dict[int, tuple[str, str | None, float]] = {}  # seq -> (subject, order id, first seen)
        self.scanned = 0
        self.placed_at: dict[str, float] = {}  # order id -> when place_order was called for it (no event before)
        self.published: set[str] = set()  # order ids of every publish on the stream's subjects, stored or refused
        self._lock = asyncio.Lock()
        self._sub: Any = None

    async def listen(self) -> None:
        """Take a copy of every publish on the stream's subjects: core NATS delivers it whether or not the stream
        stores it."""

        async def seen(msg: Any) -> None:
            if oid := order_id(msg.data or b""):
                self.published.add(oid)

        self._sub = await self.run.nc.subscribe(self.run.names.subject("orders.>"), cb=seen)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def attempted(self, oid: str) -> bool:
        """A publish about that order reached the server (stored or refused: the grader's copy of every publish)."""
        await self.run.nc.flush()
        return oid in self.published

    async def holds_accepted(self, plan: Plan) -> bool:
        """Every order placed and accepted so far has its event in the stream."""
        await self.scan()
        return all(self.seqs(o.id) for o in plan.orders if o.accepted)

    async def scan(self) -> None:
        """Read every event stored since the last scan."""
        from nats.js.errors import NotFoundError

        async with self._lock:
            info = await self.run.js.stream_info(self.run.names.stream(STREAM))
            for seq in range(self.scanned + 1, info.state.last_seq + 1):
                try:
                    raw = await self.run.js.get_msg(self.run.names.stream(STREAM), seq)
                except NotFoundError:
                    continue
                self.events[seq] = (raw.subject or "", order_id(raw.data or b""), time.time())
            self.scanned = max(self.scanned, info.state.last_seq)

    def seqs(self, oid: str) -> list[int]:
        """The stream sequences of the order's events on orders.placed, the subject both durables deliver."""
        return [s for s, (subject, o, _) in self.events.items() if o == oid and subject == self.placed]

    def elsewhere(self, oid: str) -> str:
        """A sentence if the order's event is in the stream only on subjects no durable delivers, else ''."""
        if self.seqs(oid):
            return ""
        subjects = sorted({subject for subject, o, _ in self.events.values() if o == oid})
        if not subjects:
            return ""
        return (
            f"The stream holds an event for {oid} on {', '.join(subjects)}, which neither durable delivers: "
            f"they deliver {self.placed}."
        )

    @property
    def placed(self) -> str:
        return self.run.names.subject(SUBJECT)

    @property
    def last_placed(self) -> int:
        return max((s for s, (subject, _, _) in self.events.items() if subject == self.placed), default=0)


class OrderDesk:
    """The order-service processes: calls one order at a time, restarts a process the grader stopped."""

    def __init__(self, run: Run, children: dict[str, Child], email: HeldSpawns, stream: Stream) -> None:
        self.run = run
        self.children = children
        self.email = email
        self.stream = stream
        self.hung = 0

    async def place(self, order: Order) -> Order:
        order.email_state = "up" if any(c.alive for c in self.email.released) else "down"
        order.started = order.ended = time.time()
        if self.hung >= MAX_HUNG:
            order.skipped = True
            return order
        child = self.children[order.service]
        if not child.alive:  # stopped for a hung call: a fresh process for the next order
            child = self.children[order.service] = await self.run.spawn("orders", params=PARAMS)
        order.started = time.time()
        self.stream.placed_at[order.id] = order.started
        order.reply = await child.call("place_order", CALL_DEADLINE, order=order.body)
        order.ended = time.time()
        self.hung += order.reply.hung
        await self.stream.scan()  # so a trace can say when its event was first seen in the stream
        return order


# --- the grader ----------------------------------------------------------------------------------


@dataclass
class Idle:
    """Rule 2's evidence (rules.IdleProof) and the late order it is judged on."""

    proof: rules.IdleProof
    late: Order


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults, phase by phase, and judge the invariants."""
    plan = Plan.draw(run.seed)
    # A planned kill lands only on emails about the run's orders. All of them from the start: the email worker
    # runs before the first order is placed, and calls made while no key is registered would count.
    run.workload.add(*(order.id for order in plan.orders))
    await _provision(run.js, run.names)
    shop, stream = _storefront(run, plan), Stream(run)
    watch = await EMAIL_TOPOLOGY.watch(run)
    await stream.listen()
    await shop.start()
    email = HeldSpawns(run, "email_worker", plan.faults, limit=len(plan.crashes) + 1, params=PARAMS)
    provider = Provider(run, email)
    run.on("send_email", provider.send_email)
    run.workload.only("send_email")
    run.workload.held("send_email")  # and only on an event delivered to that worker
    email.prepare(len(plan.crashes) + 1)
    try:
        orders = await asyncio.gather(run.spawn("orders", params=PARAMS), run.spawn("orders", params=PARAMS))
        desk = OrderDesk(run, {"A": orders[0], "B": orders[1]}, email, stream)
        idle = await _workload(run, plan, shop, stream, watch, email, desk)
    finally:
        await email.cancel()
        await shop.stop()
        await watch.stop()
        await stream.stop()
    await email.settle()  # so rule 6 knows when each worker ended, and rule 3 sees one that ended on its own
    await stream.scan()
    if not provider.planned.fired:
        who = f"email worker #3 (pid {provider.worker.pid})" if provider.worker else "email worker #3"
        provider.planned.seen = f"{who} made no env.send_email call"
    return judge(Evidence(run, plan, stream, watch, email, await EMAIL_TOPOLOGY.info(run), idle, provider))


async def _workload(
    run: Run, plan: Plan, shop: Storefront, stream: Stream, watch: BrokerWatch, email: HeldSpawns, desk: OrderDesk
) -> Idle:
    phase = Phases(run)

    async def drained(topology: Topology) -> bool:
        # Also past the last event the stream stored: a durable learns of a new one a moment later.
        await stream.scan()
        info = await topology.info(run)
        return rules.drained(info) and info.delivered.stream_seq >= stream.last_placed

    def decided() -> bool:
        """An email went out more often than the crashes allow: waiting longer only adds more."""
        for child in email.released:
            email.note_end(child)
        return bool(_email_excess(run, watch, stream, email.ended, settled=False))

    async def crash_or_idle(child: Child) -> None:
        """Wait for the child's planned crash, unless it can no longer come (nothing left for it to email)."""

        async def over() -> bool:
            return not child.alive or decided() or await drained(EMAIL_TOPOLOGY)

        await run.wait_for(over, CRASH_DEADLINE)
        await email.stop(child)

    async with phase("every service up, then email down"):  # the two extras fall where the seed put them
        w1 = await email.release()
        assert w1 is not None
        # A worker on the durable shows it is running with its first pull; a worker of another kind
        # shows nothing the grader can see, so it gets a moment to subscribe before the first order.
        await run.wait_for(lambda: bool(watch.pulls) or not w1.alive, W1_SETTLE)
        for step in [o.id for o in plan.orders[:2]] + plan.middle:
            if step == "WAIT":
                await crash_or_idle(w1)
                continue
            order = plan.get(step)
            if order.role == "stream_refused":
                # The refusal meets this order's publish and no other, on every replay: an earlier order's event
                # published in the background is in the stream before it starts, and it lasts until a publish
                # about this order reached the server (one made after place_order returned too).
                await run.wait_for(functools.partial(stream.holds_accepted, plan), STORE_WAIT)
                async with refuse_publishes(run.js, run.names.stream(STREAM)):
                    await desk.place(order)
                    await run.wait_for(functools.partial(stream.attempted, order.id), STORE_WAIT)
                    await stream.scan()  # while still refusing: nothing can have been added since
                    run.log.record("note", "refused_window_checked", order.id, present=bool(stream.seqs(order.id)))
            else:
                await desk.place(order)
            if w1.alive and order.accepted:
                # One order at a time for email worker #1: its planned crash then falls on the same order
                # on every replay of a seed, whatever its batch size.
                await run.wait_for(_emailed_or_gone(run, order.id, w1), SERIAL_WAIT)
    async with phase("inventory down"):
        await shop.set("inventory", "down")
        run.log.record("note", "inventory_down", None, role="inventory")
        await desk.place(plan.one("inventory_down"))
        await shop.set("inventory", "up")
        run.log.record("note", "inventory_up", None, role="inventory")
    async with phase("inventory silent, email worker #2"):  # the silent order in the other process
        silent = asyncio.ensure_future(desk.place(plan.one("inventory_silent")))
        w2 = await email.release()
        assert w2 is not None
        await crash_or_idle(w2)
    async with phase("email worker #3 catches up"):
        w3 = await email.release()
        assert w3 is not None
        released = time.time()

        def unread() -> bool:
            """No worker has ever asked the durable for events, long after the last one started."""
            return not watch.pulls and time.time() - released > FIRST_PULL

        async def caught_up() -> bool:
            return decided() or unread() or await drained(EMAIL_TOPOLOGY)

        was_drained = await run.wait_for(caught_up, CATCH_UP) and await drained(EMAIL_TOPOLOGY)
    async with phase("quiet spell"):  # rule 2: the running worker asks again after an empty fetch...
        since = watch.acks[-1].ts if watch.acks else time.time()
        refetch = await _wait_for_refetch(run, watch, w3, since) if was_drained else None
        waited = time.time() - since
    async with phase("late order"):  # ... and emails an order that comes later
        late = plan.one("late")
        late_at = time.time()
        await desk.place(late)
        await run.wait_for(lambda: bool(_emails(run).get(late.id)) or not w3.alive, LATE_DEADLINE)
        await silent
    async with phase("settle"):

        async def settled() -> bool:
            # Loyalty is the course's: it always catches up, so what it awarded never depends on when the run ended.
            email_done = decided() or unread() or await drained(EMAIL_TOPOLOGY)
            return email_done and await drained(LOYALTY_TOPOLOGY)

        await run.wait_for(settled, SETTLE)
    proof = rules.IdleProof(late.id, late_at, since, was_drained, refetch, waited, LATE_DEADLINE)
    return Idle(proof, late)


def _emailed_or_gone(run: Run, oid: str, worker: Child) -> Callable[[], bool]:
    return lambda: oid in _emails(run) or not worker.alive


async def _wait_for_refetch(run: Run, watch: BrokerWatch, worker: Child, since: float) -> Any:
    """Wait until the broker saw the worker ask again after an empty fetch (BrokerWatch.refetched_after_idle).

    A worker that sends no pull with an expiry within FIRST_PULL will not: no longer wait for it.
    """
    started = time.monotonic()

    def first() -> Any:
        return next((p for p in watch.pulls if p.ts >= since and p.expires > 0), None)

    if await run.wait_for(lambda: first() is not None or not worker.alive, FIRST_PULL) and first() is not None:
        budget = min(first().expires + IDLE_MARGIN, IDLE_CAP - (time.monotonic() - started))
        await run.wait_for(lambda: watch.refetched_after_idle(since) is not None or not worker.alive, budget)
    return watch.refetched_after_idle(since)


# --- evidence helpers --------------------------------------------------------------------------------


def _emails(run: Run) -> dict[str, list[Any]]:
    """The emails about the run's orders, by order (one about no order is effects_on_the_workload's)."""
    by_order: dict[str, list[Any]] = {}
    for event in run.log.events("effect", "send_email"):
        if event.key in run.workload.keys:
            by_order.setdefault(event.key or "", []).append(event)
    return by_order


def _awards(run: Run) -> dict[str, list[Any]]:
    by_order: dict[str, list[Any]] = {}
    for event in run.log.events("effect", "award_points"):
        by_order.setdefault(event.key or "", []).append(event)
    return by_order


def _allowance(run: Run, watch: BrokerWatch, stream: Stream, ended: dict[int, float], oid: str) -> rules.Allowance:
    """Rule 6 for one order's emails (rules.allowance), over its events on orders.placed.

    Only for a delivery the killed worker was still working on: one that emailed an order placed after
    this order's email had fetched again since, so it was done with this one (its ack held back).
    """

    def moved_on(pid: int, ts: float) -> bool:
        return _moved_on(run, stream, pid, ts) is not None

    return rules.allowance(ended, _emails(run).get(oid, []), watch, stream.seqs(oid), moved_on)


def _moved_on(run: Run, stream: Stream, pid: int, ts: float) -> Any:
    """The first email `pid` sent after `ts` for an order placed after `ts` (new work), or None."""
    return next(
        (
            e
            for e in run.log.events("effect", "send_email")
            if e.pid == pid and e.ts > ts and stream.placed_at.get(str(e.key), 0.0) > ts
        ),
        None,
    )


def _allowed(allowance: rules.Allowance, watch: BrokerWatch) -> int:
    # A durable nobody ever pulled from delivered nothing: every email then came from a consumer of the
    # worker's own, which the durable's evidence cannot excuse.
    return allowance.allowed if watch.pulls else 1


def _email_excess(
    run: Run, watch: BrokerWatch, stream: Stream, ended: dict[int, float], *, settled: bool = True
) -> dict[str, int]:
    """Orders emailed more often than the evidence allows, and by how much.

    While the run goes on (`settled=False`) the ack of a legitimate redelivery may still be on its
    way, so only the ended workers count there: an excess then is already certain.
    """
    excess = {}
    for oid, events in _emails(run).items():
        allowance = _allowance(run, watch, stream, ended, oid)
        limit = _allowed(allowance, watch) if settled else 1 + len(allowance.held)
        if len(events) > limit:
            excess[oid] = len(events) - limit
    return excess


def _of(some: list[Any], all_: list[Any], noun: str, be: bool = True) -> str:
    """'1 of 8 accepted orders was' / '2 of 8 accepted orders were' (without the verb if not `be`)."""
    verb = (" was" if len(some) == 1 else " were") if be else ""
    return f"{len(some)} of {plural(len(all_), noun)}{verb}"


@dataclass
class Evidence:
    """Everything judged, and a story per order for the traces."""

    run: Run
    plan: Plan
    stream: Stream
    watch: BrokerWatch
    email: HeldSpawns  # the email worker's incarnations, released in order
    info: Any  # the durable 'email' at the end
    idle: Idle
    provider: Provider  # the email provider's outage for worker #3

    def at(self, ts: float) -> str:
        return self.run.at(ts)

    @property
    def last_worker(self) -> Child:
        return self.email.released[-1]

    def label(self, pid: int) -> str:
        for n, child in enumerate(self.email.released, 1):
            if child.pid == pid:
                return f"email worker #{n} (pid {pid})"
        return f"process {pid}"

    def notes(self, name: str, oid: str) -> list[Any]:
        return [e for e in self.run.log.events("note", name) if e.key == oid]

    def trace(self, oid: str) -> list[str]:
        """What happened to one order, in time order, one line each."""
        order = self.plan.get(oid)
        steps = Trace(self.run, TRACE_LINES)
        if order.reply is not None:
            words = ROLE_WORDS[order.role]
            steps.add(order.started, f"{oid} {words} (email worker {order.email_state})")
            steps.add(order.ended, f"place_order {order.outcome()}")
        for e in self.notes("inventory_answered", oid):
            steps.add(e.ts, f"inventory answered reserved={str(e.detail.get('reserved')).lower()}")
        for e in self.notes("inventory_ignored", oid):
            steps.add(e.ts, "inventory received the request and never answered (silent)")
        for e in self.notes("loyalty_ignored", oid):
            steps.add(e.ts, "loyalty received a request and never answered (silent)")
        for e in self.run.log.events("effect", "save_order"):
            if e.key == oid:
                steps.add(e.ts, f"saved by the order service (pid {e.pid})")
        for seq in self.stream.seqs(oid):
            first_seen = self.stream.events[seq][2]
            steps.add(first_seen, f"its event is in the stream at seq {seq} (seen by the grader)")
            for ack in self.watch.of(seq):
                steps.add(
                    ack.ts, f"by now the broker has the worker's {ack.kind} for seq {seq} (delivery {ack.delivered})"
                )
        for e in self.run.log.events("crash", "send_email"):
            if e.key == oid:
                steps.add(e.ts, f"{self.label(e.pid)} SIGKILLed {WHERE[e.detail['when']]} (injected)")
        for e in self.provider.refused:
            if e.key == oid:
                steps.add(e.ts, f"{self.label(e.pid)}'s env.send_email raised {OUTAGE_ERROR}: provider down (injected)")
        for e in _emails(self.run).get(oid, []):
            steps.add(e.ts, f"emailed by {self.label(e.pid)}")
        for e in _awards(self.run).get(oid, []):
            how = (
                "when place_order asked it" if e.detail.get("via") == "request" else f"from event seq {e.detail['seq']}"
            )
            steps.add(e.ts, f"loyalty awarded points {how}")
        return steps.lines()


def judge(ev: Evidence) -> list[Check]:
    """The lab's checks (grade.py adds the platform's faults_fired and no_unplanned_deaths)."""
    crash_at = _first_crash(ev.run)
    return [
        _accepts_up(ev, crash_at),
        _accepts_loyalty_silent(ev),
        _accepts_email_down(ev, crash_at),
        _refuses_out_of_stock(ev),
        _refuses_inventory_down(ev),
        _refuses_inventory_silent(ev),
        _accepted_means_stored(ev),
        _refused_never_announced(ev),
        _lost_check(ev),
        _duplicate_check(ev),
        _outage_check(ev),
        _acked_check(ev),
        _loyalty_check(ev),
        _idle_check(ev),
        ev.run.workload_check("email"),
    ]


def _first_crash(run: Run) -> float:
    crashes = run.log.events("crash", "send_email")
    return crashes[0].ts if crashes else float("inf")


def _refusal_story(ev: Evidence, order: Order) -> tuple[str, str]:
    """Why an order that should have been accepted was not: (evidence sentence, hint that fits it)."""
    oid = order.id
    value = order.value
    loyalty_silent = ev.notes("loyalty_ignored", oid)
    inventory = ev.notes("inventory_answered", oid)
    error = str(value.get("error", ""))
    if order.skipped:
        return ("", "every call place_order waits on needs a bound: the orders that hung show where it waited")
    if order.kind == "hung":
        return (
            "place_order never returned, so the customer never heard back.",
            "every call place_order waits on needs a bound; a service that merely reacts needs no call at all",
        )
    if inventory and not inventory[-1].detail.get("reserved"):
        return (
            f"The inventory answered reserved=false: the request it received named no sku ({order.sku} has stock).",
            "send the inventory the order itself, as JSON: it reads the order's sku and qty",
        )
    email_down = order.email_state == "down" or order.started >= _first_crash(ev.run)
    # The same code accepted an order while the email worker ran: the failure came with email's absence.
    base_ok = any(o.accepted and o.email_state == "up" and o.ended < _first_crash(ev.run) for o in ev.plan.orders)
    if error in ("NoRespondersError", "TimeoutError") and inventory and email_down and base_ok:
        return (
            f"Inventory had confirmed the stock and loyalty was answering; only the email worker was down, and "
            f"place_order failed with {error}, where it had accepted orders while email ran: an order service "
            "that waits for email is only up when email is up (temporal coupling).",
            "sending the email merely reacts to the order: announce the order so email can catch up later, "
            "instead of asking the email service and waiting",
        )
    if error == "TimeoutError" and loyalty_silent:
        return (
            "place_order asked the loyalty service, which received the request and did not answer, and failed with it.",
            "awarding points merely reacts to the order: announce it instead of asking loyalty and waiting",
        )
    if error == "NoRespondersError":
        return (
            "Nobody was listening on a subject place_order asked (inventory and loyalty were).",
            "place_order still asks a service that is not there to answer; a fact needs no answer",
        )
    return (
        "",
        "an order with confirmed stock must be accepted: look at the line the error names",
    )


def _accept_check(name: str, title: str, group: list[Order], ev: Evidence, situation: str, extra: str = "") -> Check:
    refused = [o for o in group if not o.accepted or o.elapsed > ACCEPT_MAX]
    if not group or not refused:
        return Check(name, title, True)
    placed = [o for o in refused if not o.skipped]
    if not placed:
        message = (
            f"could not be tested: the {plural(len(refused), 'order')} meant to be {situation} "
            f"({', '.join(o.id for o in refused)}) "
            f"{refused[0].outcome().replace('was never called', 'were never placed')}."
        )
        return Check(name, title, False, message, hint=_refusal_story(ev, refused[0])[1])
    order = placed[0]
    story, hint = _refusal_story(ev, order)
    if order.accepted:
        story, hint = (
            f"Accepted, but only after {order.elapsed:.2f} s (allowed {ACCEPT_MAX:.1f} s).",
            "nothing that merely reacts to an order may make placing it slow",
        )
    message = (
        f"{len(refused)} of {plural(len(group), 'order')} {situation} {'was' if len(refused) == 1 else 'were'} "
        f"not accepted in time: {order.id} {order.outcome()}."
    )
    if extra:
        message += f"\n{extra}"
    if story:
        message += f"\n{story}"
    return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint)


def _accepts_up(ev: Evidence, crash_at: float) -> Check:
    # Placed and answered before the first crash: every service ran for the whole call.
    group = [o for o in ev.plan.orders if o.role in ("base", "normal") and o.email_state == "up" and o.ended < crash_at]
    return _accept_check(
        "accepts_with_services_up",
        "an order with stock is accepted while every service runs",
        group,
        ev,
        "placed while every service ran",
    )


def _accepts_email_down(ev: Evidence, crash_at: float) -> Check:
    # Every normal order placed after the first crash, up to email worker #2's start (an order the
    # crash fell in the middle of counts for neither this group nor the one before).
    group = [o for o in ev.plan.orders if o.role == "normal" and (o.email_state == "down" or o.started >= crash_at)]
    crash = ev.run.log.events("crash", "send_email")
    note = ""
    if crash:
        c = crash[0]
        note = f"{ev.label(c.pid)} had been SIGKILLed at {ev.at(c.ts)} (injected, at its email #{c.detail['call']})."
    else:
        note = "Email worker #1 never reached its planned crash; the grader stopped it."
    return _accept_check(
        "accepts_while_email_down",
        "orders are accepted while the email worker is down",
        group,
        ev,
        "placed while the email worker was down",
        extra=note,
    )


def _accepts_loyalty_silent(ev: Evidence) -> Check:
    order = ev.plan.one("loyalty_silent")
    title = "an order is accepted while the loyalty service is silent, without waiting for it"
    asked = ev.notes("loyalty_ignored", order.id)
    waited = asked and order.accepted and order.ended - asked[0].ts >= WAITED_ON_LOYALTY
    if order.accepted and order.elapsed <= ACCEPT_MAX and not waited:
        return Check("accepts_while_loyalty_silent", title, True)
    situation = f"{order.id} was placed while the loyalty service was silent (it received requests and answered none)."
    if waited:
        message = (
            f"{situation}\nplace_order accepted it, but returned only {order.ended - asked[0].ts:.2f} s after the "
            "loyalty service received its request: the customer waited for a service that merely reacts."
        )
        hint = "awarding points merely reacts to an order: announce the order instead of asking loyalty and waiting"
    else:
        story, hint = _refusal_story(ev, order)
        if order.accepted:
            story = f"Accepted, but only after {order.elapsed:.2f} s (allowed {ACCEPT_MAX:.1f} s)."
            hint = "nothing that merely reacts to an order may make placing it slow"
        message = f"{situation}\nplace_order {order.outcome()}."
        if asked and not order.accepted:
            message += (
                f"\nThe loyalty service had received place_order's request about {order.id} at {ev.at(asked[0].ts)} "
                "and never answered: the order failed because loyalty was silent."
            )
            hint = "awarding points merely reacts to an order: announce the order instead of asking loyalty and waiting"
        elif story:
            message += f"\n{story}"
    return Check("accepts_while_loyalty_silent", title, False, message, trace=ev.trace(order.id), hint=hint)


def _refusal_check(name: str, title: str, order: Order, ev: Evidence, want: str, situation: str) -> Check:
    """Shared shape of the three refusal checks: the right exception, and (for inventory) in time."""
    if order.kind == want:
        return Check(name, title, True)
    wanted = {"out_of_stock": "OutOfStock", "inventory_unavailable": "InventoryUnavailable"}[want]
    if order.skipped:
        return Check(
            name,
            title,
            False,
            f"could not be tested: {order.id} would have been {situation}, but place_order {order.outcome()}.",
            hint="every call place_order waits on needs a bound: the orders that hung show where it waited",
        )
    message = f"{order.id} was {situation}: place_order {order.outcome()}."
    if order.accepted:
        message += "\nThe order was accepted although no stock was confirmed for it."
        hint = "accept an order only once the inventory has confirmed its stock; otherwise raise " + wanted
    elif order.kind == "hung":
        hint = f"give up after env.request_timeout and raise {wanted}: the customer is told at once"
    else:
        message += f"\nThe interface says {wanted}: the customer is told why (defined in your file; keep its name)."
        hint = f"turn this failure into {wanted}"
    return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint)


def _refuses_out_of_stock(ev: Evidence) -> Check:
    order = ev.plan.one("out_of_stock")
    title = "an order the inventory has no stock for is refused with OutOfStock"
    check = _refusal_check(
        "refuses_out_of_stock", title, order, ev, "out_of_stock", f"placed with no stock for {order.sku}"
    )
    if not check.passed and not order.skipped and not ev.notes("inventory_answered", order.id):
        check.message += f"\nThe inventory service never received a request about {order.id}."
        check.hint = "ask the inventory service to reserve the stock before accepting the order"
    elif not check.passed and order.accepted:
        check.message += ' The inventory had answered {"reserved": false}.'
    return check


def _refuses_inventory_down(ev: Evidence) -> Check:
    order = ev.plan.one("inventory_down")
    title = "with nobody listening for inventory, an order is refused at once with InventoryUnavailable"
    situation = "placed while nobody was subscribed to the inventory subject"
    check = _refusal_check("refuses_inventory_down", title, order, ev, "inventory_unavailable", situation)
    if check.passed and order.elapsed > DOWN_MAX:
        check = Check(
            "refuses_inventory_down",
            title,
            False,
            f"{order.id} was {situation}: place_order raised InventoryUnavailable, but only after "
            f"{order.elapsed:.2f} s (allowed {DOWN_MAX:.1f} s). The server says at once that nobody listens.",
            trace=ev.trace(order.id),
            hint="when nobody listens, the answer is known at once: refuse right away instead of trying again",
        )
    elif not check.passed and order.value.get("error") == "NoRespondersError":
        check.message += " NoRespondersError is how the server says nobody listens."
    return check


def _refuses_inventory_silent(ev: Evidence) -> Check:
    order = ev.plan.one("inventory_silent")
    title = (
        f"with inventory silent, an order is refused with InventoryUnavailable after env.request_timeout "
        f"({REQUEST_TIMEOUT:.1f} s), not sooner"
    )
    name = "refuses_inventory_silent"
    received = ev.notes("inventory_ignored", order.id)
    situation = "placed while the inventory service was silent"
    if received:
        situation += f" (it received the request at {ev.at(received[0].ts)} and never answered)"
    check = _refusal_check(name, title, order, ev, "inventory_unavailable", situation)
    too_soon = order.elapsed < SILENT_MIN and order.kind not in ("", "hung", "skipped")
    if too_soon:
        message = (
            f"{order.id} was {situation}: place_order {order.outcome()}.\nIt gave up after {order.elapsed:.2f} s, "
            f"before env.request_timeout ({REQUEST_TIMEOUT:.1f} s): the inventory is allowed that long to answer, so "
            f"giving up sooner refuses orders it would still have confirmed in time."
        )
        if not check.passed:
            message += f" And the interface says InventoryUnavailable, not {order.value.get('error')}."
        return Check(
            name,
            title,
            False,
            message,
            trace=ev.trace(order.id),
            hint="wait for the inventory's answer exactly env.request_timeout seconds "
            "(a request without a timeout of its own gives up after nats-py's default, 0.5 s)",
        )
    if check.passed and (len(received) > 1 or order.elapsed > SILENT_MAX):
        asked = f"the inventory received {len(received)} requests about it, and " if len(received) > 1 else ""
        return Check(
            name,
            title,
            False,
            f"{order.id} was {situation}: {asked}place_order raised InventoryUnavailable after {order.elapsed:.2f} s: "
            "the customer waited longer than env.request_timeout.",
            trace=ev.trace(order.id),
            hint="give up once env.request_timeout has passed, and do not ask again in place_order",
        )
    if not check.passed and not received and not order.skipped:
        check.message += f"\nThe inventory service never received a request about {order.id}."
    return check


def _accepted_means_stored(ev: Evidence) -> Check:
    title = "an order is reported accepted only once the stream has stored its event"
    name = "accepted_means_stored"
    refused_window = ev.plan.one("stream_refused")
    window = [e for e in ev.run.log.events("note", "refused_window_checked") if e.key == refused_window.id]
    missing = [o for o in ev.plan.orders if o.accepted and not ev.stream.seqs(o.id)]
    hint_publish = (
        "an order counts as accepted only once the stream has confirmed it stored the event: wait for that "
        "confirmation, and let place_order fail when it does not come (a core NATS publish is never confirmed)"
    )
    if refused_window.kind == "hung":
        order = refused_window
        message = (
            f"{order.id} was placed while the stream refused every publish (the grader had made it full), and "
            f"place_order {order.outcome()}: when the stream refuses, the customer must be told at once that the "
            "order was not accepted."
        )
        hint = "when the stream refuses the event, let place_order raise: do not wait or try again for ever"
        return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint)
    if refused_window.accepted and window and not window[0].detail.get("present"):
        order = refused_window
        seqs = ev.stream.seqs(order.id)
        message = (
            f"{order.id} was placed while the stream refused every publish (the grader had made it full). "
            f"place_order {order.outcome()}, and at that moment the stream held no event for {order.id}."
        )
        if seqs:
            message += (
                f"\nIts event reached the stream only later (seq {seqs[0]}), after place_order had reported "
                "the order accepted: had the stream kept refusing, it would have been lost."
            )
        else:
            message += "\nNo event for it ever reached the stream: email and loyalty will never hear of this order."
        if not ev.stream.events:
            hint_publish = (
                "nothing place_order did ever reached the stream: the reacting services read the stream, so "
                "announce each accepted order there, and report it accepted only once the stream confirmed it"
            )
        return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint_publish)
    if not missing:
        return Check(name, title, True)
    order = missing[0]
    elsewhere = ev.stream.elsewhere(order.id)
    message = (
        f"{plural(len(missing), 'accepted order')} {'has' if len(missing) == 1 else 'have'} no event on "
        f"{ev.stream.placed} in the stream: {', '.join(o.id for o in missing)}. Accepted means the stream holds "
        "the order's event, for email and loyalty to read whenever they can, also after a crash."
    )
    hint = hint_publish
    if elsewhere:
        message += f"\n{elsewhere}"
        hint = f"announce orders on env.subject('{SUBJECT}'): that is what the durables of email and loyalty deliver"
    elif not ev.stream.events:
        hint = (
            "nothing place_order did ever reached the stream: announce each accepted order on the stream the "
            "reacting services read, and report it accepted only once the stream confirmed it"
        )
    return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint)


def _refused_never_announced(ev: Evidence) -> Check:
    title = "an order that is not accepted never reaches email or loyalty"
    name = "refused_never_announced"
    emails, awards = _emails(ev.run), _awards(ev.run)
    announced = [
        o for o in ev.plan.orders if o.reply is not None and not o.accepted and (o.id in emails or o.id in awards)
    ]
    if not announced:
        return Check(name, title, True)
    order = announced[0]
    reached = []
    if order.id in emails:
        reached.append(f"emailed by {ev.label(emails[order.id][0].pid)} at {ev.at(emails[order.id][0].ts)}")
    if order.id in awards:
        reached.append(f"given loyalty points at {ev.at(awards[order.id][0].ts)}")
    told = "never heard back" if order.kind == "hung" else "was told no"
    message = (
        f"{plural(len(announced), 'order')} not accepted reached a reacting service: {order.id} "
        f"({ROLE_WORDS[order.role]}) was not accepted (place_order {order.outcome()}), yet it was "
        f"{' and '.join(reached)}. The customer {told}, and got a confirmation anyway."
    )
    if ev.stream.seqs(order.id):
        hint = (
            f"the event for {order.id} was published although the order was then refused: announce an order only "
            "once everything that can refuse it has said yes"
        )
    else:
        hint = "place_order told a reacting service about the order before it knew the order would be accepted"
    return Check(name, title, False, message, trace=ev.trace(order.id), hint=hint)


def _lost_check(ev: Evidence) -> Check:
    title = "every accepted order is emailed (none lost, whatever crashed)"
    emails = _emails(ev.run)
    accepted = [o for o in ev.plan.orders if o.accepted]
    lost = [o for o in accepted if o.id not in emails]
    if not lost:
        return Check("no_lost_emails", title, True)
    crashed = {e.key for e in ev.run.log.events("crash", "send_email") if e.detail.get("when") == "before"}
    order = next((o for o in lost if o.id in crashed), lost[0])
    seqs = ev.stream.seqs(order.id)
    message = f"{_of(lost, accepted, 'accepted order')} never emailed: {', '.join(o.id for o in lost)}."
    acks = [a for s in seqs for a in ev.watch.of(s) if a.kind == "ack"]
    hint = "consume the durable env.durable('email') and ack each event only after its email went out"
    if not seqs:
        message += "\n" + (
            ev.stream.elsewhere(order.id)
            or f"The stream holds no event for {order.id}, so the email worker had nothing to read."
        )
        hint = "announce every accepted order on the stream the email worker reads"
    elif order.id in crashed and acks:
        crash = next(e for e in ev.run.log.events("crash", "send_email") if e.key == order.id)
        message += (
            f"\nThe broker received an ack for its event (seq {seqs[0]}, delivery {acks[0].delivered}) although no "
            f"email for it ever went out: it was acked before its email, and {ev.label(crash.pid)} was "
            "SIGKILLed in between. An acked message never comes back."
        )
        hint = "ack an event only after its email went out: then a crash before the ack means redelivery, not loss"
    elif acks:
        message += (
            f"\nThe broker received an ack for {order.id}'s event (seq {seqs[0]}) at {ev.at(acks[0].ts)}, yet no "
            "email went out for it: an acked message never comes back."
        )
        hint = "email every event you take from the durable, then ack it"
    elif ev.info.num_pending or ev.info.num_ack_pending:
        message += (
            f"\nThe durable '{EMAIL}' still held {ev.info.num_pending} undelivered and {ev.info.num_ack_pending} "
            f"unacked events when the run ended ({CATCH_UP:.0f} s after the last worker started)."
        )
        if not ev.watch.pulls:
            message += f" No worker ever asked the durable '{EMAIL}' for events."
            hint = f"the email worker must read the durable env.durable('{EMAIL}') the platform made for it"
    w3 = ev.last_worker
    if w3.died or w3.returned:
        message += f"\nThe last email worker {w3.how_it_ended()}, so nothing emailed what was left."
        if ev.info.num_pending or ev.info.num_ack_pending:
            hint = "a worker runs until it is stopped: nothing about one event is a reason to end it"
    return Check("no_lost_emails", title, False, message, trace=[*ev.trace(order.id), "never emailed"], hint=hint)


def _duplicate_check(ev: Evidence) -> Check:
    title = "no order is emailed twice, except for an event a killed worker was still working on"
    emails = _emails(ev.run)
    extra = _email_excess(ev.run, ev.watch, ev.stream, ev.email.ended)
    if not extra:
        return Check("no_duplicate_emails", title, True)
    oid = next(iter(extra))
    sent = emails[oid]
    allowance = _allowance(ev.run, ev.watch, ev.stream, ev.email.ended, oid)
    who = ", ".join(dict.fromkeys(ev.label(e.pid) for e in sent))
    counted = allowance.deliveries is None or 1 + len(allowance.held) <= allowance.deliveries
    why = f" ({'; '.join(_held(ev, pid) for pid in allowance.held)})" if allowance.held and counted else ""
    message = (
        f"{plural(len(extra), 'order')} emailed more often than the crashes explain: {oid} {len(sent)} times "
        f"(by {who}); allowed {_allowed(allowance, ev.watch)}{why if ev.watch.pulls else ''}."
    )
    # Workers that ended holding it, but had gone on to orders placed after its email: not excused.
    unexcused = rules.allowance(ev.email.ended, sent, ev.watch, ev.stream.seqs(oid)).held
    moved = [pid for pid in unexcused if pid not in allowance.held]
    if not ev.watch.pulls:
        message += (
            f"\nThe durable '{EMAIL}' never delivered {oid}: no worker ever asked it for events. A consumer of your "
            "own starts again from the start of the stream each time a worker restarts."
        )
        hint = f"bind the email worker to the durable env.durable('{EMAIL}'): it remembers what was acked"
    elif moved and any(a.kind == "ack" for a in ev.watch.acks):  # it does ack, only too late
        mine = [e for e in sent if e.pid == moved[0]]
        later = _moved_on(ev.run, ev.stream, moved[0], mine[-1].ts)
        placed = ev.at(ev.stream.placed_at[str(later.key)])
        message += (
            f"\n{ev.label(moved[0])} emailed {oid} at {ev.at(mine[-1].ts)} and went on to email {later.key} (placed at "
            f"{placed}, after that) before it ended, yet the broker never had {oid}'s "
            "ack: the worker was done with it, and its ack was held back. A crash excuses a second email only for an "
            "event the worker was still working on."
        )
        hint = (
            "ack each event once its email went out, before you take new ones: an ack held back is lost with the worker"
        )
    elif allowance.deliveries is None:
        message += (
            f"\nNo ack for {oid} ever reached the broker, so it delivered the event again after every ack_wait "
            f"({ACK_WAIT:.1f} s) while a worker was alive, not only after a crash."
        )
        hint = "ack every event once its email went out; an un-acked event comes back after ack_wait"
    elif allowance.deliveries < len(sent):
        message += (
            f"\nThe acks the durable '{EMAIL}' received show {plural(allowance.deliveries, 'delivery')} of {oid}, yet "
            f"it was emailed {len(sent)} times: some deliveries were emailed more than once, or came from a consumer"
            " of your own."
        )
        hint = f"email each event you take from the durable env.durable('{EMAIL}') once, then ack it"
    else:
        message += (
            f"\nThe broker delivered it again because no ack came within ack_wait ({ACK_WAIT:.1f} s) while the "
            "worker was alive, not because a crash interrupted it."
        )
        hint = "ack every event once its email went out; an un-acked event comes back after ack_wait"
    return Check("no_duplicate_emails", title, False, message, trace=ev.trace(oid), hint=hint)


def _outage_check(ev: Evidence) -> Check:
    """The transfer: an email the provider refused is not done; it goes out later, and the worker lives on."""
    name = "survives_email_outage"
    title = "an email the provider refused goes out later, and the worker keeps running"
    worker, refused = ev.provider.worker, ev.provider.refused
    if worker is None or not refused:
        who = ev.label(worker.pid) if worker else "email worker #3"
        return Check(
            name,
            title,
            False,
            f"could not be tested: {who} made no env.send_email call, so the email provider (down for its first "
            f"{plural(OUTAGE_CALLS, 'call')}) never refused one.",
            hint="fix the other email checks first: the last worker must email the events left on the durable",
        )
    emails = _emails(ev.run)
    never = [oid for oid in ev.provider.refused_ids() if oid not in emails]
    label, first = ev.label(worker.pid), refused[0]
    story = (
        f"The email provider was down for {label}'s first {plural(OUTAGE_CALLS, 'env.send_email call')}: the call "
        f"for {first.key} at {ev.at(first.ts)} raised {OUTAGE_ERROR}, and no email went out."
    )
    if worker.died or worker.returned:
        hint = (
            "a failed email is a reason to send it again later, not to end the worker: keep the event for another"
            " delivery and carry on with the next"
        )
        if worker.died:
            message = f"{story}\n{label} then {rules.how_ended(worker)}: a failed email ended the worker."
        else:  # on the failure itself, or on an empty fetch before the refused event came back: both end it
            message = (
                f"{story}\n{label} then {rules.how_ended(worker)} with the refused email not yet sent: the worker "
                "ended before the event came back for another try."
            )
            hint += " (an empty fetch meanwhile means 'nothing yet': the un-acked event comes back after ack_wait)"
        if never:
            message += f" {', '.join(never)} never got its email."
        return Check(name, title, False, message, trace=ev.trace(str(first.key)), hint=hint)
    if not never:
        return Check(name, title, True)
    oid = never[0]
    message = f"{story}\n{_of(never, ev.provider.refused_ids(), 'refused email')} never sent later: {', '.join(never)}."
    settled = [a for s in ev.stream.seqs(oid) for a in ev.watch.of(s) if a.kind in ("ack", "term")]
    refusal = next(e for e in refused if e.key == oid)
    if settled and settled[-1].ts >= refusal.ts:
        message += (
            f"\nYet the broker received {an(settled[-1].kind)} for its event (seq {settled[-1].stream_seq}) at "
            f"{ev.at(settled[-1].ts)}, after the failed call: the worker reported the email done although it had "
            "failed, and an acked event never comes back."
        )
        hint = (
            "an email the provider refused is not done: settle its event only once the email went out, so the broker"
            " delivers it again"
        )
    else:
        hint = "an email the provider refused must be sent again later: let the broker deliver its event again"
    return Check(name, title, False, message, trace=[*ev.trace(oid), "never emailed"], hint=hint)


def _held(ev: Evidence, pid: int) -> str:
    """Rule 6's evidence for one worker, in a phrase."""
    how = "was SIGKILLed" if any(e.pid == pid for e in ev.run.log.events("crash")) else "ended"
    return f"pid {pid} {how} after emailing it, before any ack of it reached the broker"


def _acked_check(ev: Evidence) -> Check:
    title = f"every order event is acked on the durable '{EMAIL}' (nothing stuck)"
    settled = {a.stream_seq for a in ev.watch.acks if a.kind in ("ack", "term")}
    events = sorted(ev.stream.events.items())
    stuck = [
        oid or f"seq {seq}" for seq, (subject, oid, _) in events if subject == ev.stream.placed and seq not in settled
    ]
    ids = {o.id for o in ev.plan.orders}
    trace = ev.trace(stuck[0]) if stuck and stuck[0] in ids else []
    extra = ""
    acks = [a for a in ev.watch.acks if a.kind == "ack"]
    if not ev.watch.pulls:
        extra = " No worker ever asked it for events: it was not read at all."
        hint = f"read from the durable env.durable('{EMAIL}') on env.stream('{STREAM}'): it exists already"
    elif not acks:
        extra = " The broker never received an ack on it."
        hint = "ack each event once its email went out"
    else:
        hint = "ack each event once its email went out, and keep consuming until every event is acked"
    last = ev.last_worker
    if ev.watch.pulls and (last.died or last.returned):
        extra += f" The last email worker {last.how_it_ended()}."
        hint = "a worker runs until it is stopped: nothing about one event is a reason to end it"
    check = rules.drained_check(
        ev.info, EMAIL, ACK_WAIT, noun="event", stuck=stuck, title=title, hint=hint, trace=trace
    )
    if not check.passed:
        check.message += extra
    return check


def _loyalty_check(ev: Evidence) -> Check:
    title = "every accepted order reaches the loyalty service exactly once"
    awards = _awards(ev.run)
    accepted = [o for o in ev.plan.orders if o.accepted]
    lost = [o for o in accepted if o.id not in awards]
    twice = [o for o in accepted if len(awards.get(o.id, [])) > 1]
    unreadable = ev.run.log.events("note", "loyalty_unreadable")
    if not lost and not twice:
        return Check("loyalty_exactly_once", title, True)
    if twice:
        order = twice[0]
        ways = Counter(str(e.detail.get("via")) for e in awards[order.id])
        message = (
            f"{plural(len(twice), 'accepted order')} reached loyalty more than once: {order.id} "
            f"{len(awards[order.id])} times ({ways['request']} by request from place_order, {ways['event']} from "
            "events on its durable)."
        )
        if ways["request"] and ways["event"]:
            hint = "loyalty already reads every order event from its durable: asking it as well awards points twice"
        else:
            hint = "announce each accepted order once"
        return Check("loyalty_exactly_once", title, False, message, trace=ev.trace(order.id), hint=hint)
    order = next((o for o in lost if o.role == "loyalty_silent"), lost[0])
    message = (
        f"{_of(lost, accepted, 'accepted order', be=False)} never reached loyalty: {', '.join(o.id for o in lost)}."
    )
    ignored = ev.notes("loyalty_ignored", order.id)
    if ignored and not ev.stream.seqs(order.id):
        message += (
            f"\n{order.id}: place_order asked the loyalty service while it was silent, and no event for it reached "
            "the stream, which loyalty's durable reads: the points are lost."
        )
        hint = "awarding points merely reacts to the order: announce the order and let loyalty read it when it can"
    elif not ev.stream.seqs(order.id):
        message += "\n" + (
            ev.stream.elsewhere(order.id)
            or f"{order.id}: no event for it reached the stream, which loyalty's durable reads."
        )
        hint = "announce every accepted order on the stream the reacting services read"
    elif unreadable:
        data = unreadable[0].detail.get("data", b"")
        message += (
            f"\nThe loyalty service could not read event seq {unreadable[0].detail.get('seq')} ({data!r}): "
            'it reads the order as JSON, with its "id".'
        )
        hint = "publish the order itself, as JSON, as the event's data"
    else:
        hint = "announce every accepted order on the stream the reacting services read"
    return Check("loyalty_exactly_once", title, False, message, trace=ev.trace(order.id), hint=hint)


def _idle_check(ev: Evidence) -> Check:
    proof, late, last = ev.idle.proof, ev.idle.late, ev.last_worker
    untested, hint_untested = _untested(ev)
    words = rules.IdleWords(
        title="the running email worker survives a quiet spell and emails a late order itself",
        done="emailed",
        hint_ended="a worker runs until it is stopped: an empty fetch means 'nothing yet', so ask again",
        hint_no_refetch="after an empty fetch, fetch again: the loop must keep asking the durable for events",
        hint_slow="keep fetching from the durable and email each event as it comes",
        untested=untested,
        hint_untested=hint_untested,
    )
    handled_by = [e.pid for e in _emails(ev.run).get(late.id, [])]
    check = rules.survives_idle(ev.run.at, proof, last, handled_by, ev.trace(late.id), words)
    if check.passed or untested or not last.alive:
        return check
    # What the broker saw of the worker's pull requests says why no refetch was seen.
    label = ev.label(last.pid)
    pulls = [p for p in ev.watch.pulls if p.ts >= proof.since]
    if proof.refetch is None and pulls and pulls[-1].expires == 0:
        check.message += (
            f"\n{label}'s pull requests carried no expiry, so it was never seen to wait out an empty fetch."
        )
        check.hint = "fetch with a timeout, and ask again when it expires empty"
    elif proof.refetch is None and pulls:
        p = pulls[-1]
        check.message += (
            f"\n{label}'s last pull request came at {ev.at(p.ts)} (waiting up to {p.expires:.2f} s) and was never"
            " followed by another: it did not ask again after an empty fetch."
        )
    return check


def _untested(ev: Evidence) -> tuple[str, str]:
    """Why this run could not test rule 2, in the lab's words, and the hint; ('', '') if it could."""
    proof, late = ev.idle.proof, ev.idle.late
    label = ev.label(ev.last_worker.pid)
    if not proof.drained:
        return (
            f"the durable '{EMAIL}' never emptied ({ev.info.num_pending} undelivered, {ev.info.num_ack_pending} "
            f"unacked at the end), so {label} never had a quiet spell. Fix the other email checks first.",
            "every event must be emailed and acked before the worker can go idle",
        )
    if not ev.watch.pulls:
        return (
            f"{label} never asked the durable '{EMAIL}' for events: no pull request reached it in the whole run, so"
            " the grader could not see it wait through a quiet spell.",
            f"the email worker reads the durable env.durable('{EMAIL}'), and asks again whenever a fetch comes back"
            " empty",
        )
    if proof.refetch is None:
        return "", ""
    survived = f"{label} asked again after an empty fetch (at {ev.at(proof.refetch.ts)})"
    if late.skipped:
        return f"{survived}, but the late order {late.id} {late.outcome()}.", "fix the hung orders first"
    if late.accepted and not ev.stream.seqs(late.id):
        return (
            f"{survived}, but the late order {late.id} has no event on {ev.stream.placed} for it to read (see the"
            " check on accepted orders and the stream).",
            "announce every accepted order first",
        )
    if not late.accepted:
        return f"{survived}, but place_order refused the late order {late.id}: {late.outcome()}.", (
            "fix the acceptance checks first"
        )
    return "", ""
