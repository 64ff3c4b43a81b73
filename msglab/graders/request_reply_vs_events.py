"""Lab 01 grader: an order service that asks only what it must, and announces the rest.

The shop (played by the grader, out of the learner's reach): an inventory service that answers
stock reservations on `inventory.reserve`, a loyalty service that answers on `loyalty.award` and
also reads every `orders.placed` event from its durable 'loyalty', the stream ORDERS with the
durables 'email' and 'loyalty'. The learner's file is the order service (`place_order`, run in
two service processes) and the email service (`email_worker`, three incarnations).

Workload (seeded), 12 orders, each with a sku of its own:
  1. every service up: o-1; then o-2 while the loyalty service ignores the request about it
     (silent); then two more, one at a time (each emailed before the next, so the crash falls on
     the same order on every replay). Email worker #1 is SIGKILLed at its email #3 or #4 (before
     or after the email goes out);
  2. email down (#1 dead, #2 not started): three more orders;
  the order the inventory has no stock for, and the order placed while the stream refuses every
     publish (full, discard-new), are slotted into 1-2 at seeded places;
  3. inventory down (nobody subscribed): one order; it must be refused at once;
  4. email worker #2 starts and is SIGKILLed at its email #1-#3 (the other of before/after);
     meanwhile the second service process places one order the inventory never answers
     (silent): refused with InventoryUnavailable, after env.request_timeout and not before;
  5. email worker #3 starts and catches up; once the durable is drained and #3 has survived an
     empty fetch (seen on the broker), a late order: #3 itself must email it.

Invariants judged on the effect log, the stream, the consumers and the acks the broker saw:
an order is accepted exactly when stock was confirmed and the stream stored its event, whatever
email and loyalty do; refusals name the cause (OutOfStock, InventoryUnavailable) and come at the
right time; refused orders are never announced; every accepted order is emailed and reaches
loyalty exactly once (an extra email only where a worker was killed holding the delivery before
its ack); the durable 'email' ends fully acked; the worker keeps running through quiet spells.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msglab.broker import settle_subscriptions
from msglab.grading.harness import Child, Reply, Run
from msglab.grading.labkit import LabEnv, provision
from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import BrokerWatch, refuse_publishes
from msglab.grading.verdict import Check

STREAM = "ORDERS"
SUBJECT = "orders.placed"
EMAIL, LOYALTY = "email", "loyalty"  # the durables on SUBJECT
INVENTORY = "inventory.reserve"
LOYALTY_ASK = "loyalty.award"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more, a lab cannot wait that long
REQUEST_TIMEOUT = 0.8  # env.request_timeout: not nats-py's default (0.5 s), so a missing timeout shows
SILENT_MIN = REQUEST_TIMEOUT - 0.01  # giving up on a silent inventory sooner than this ignores the timeout
SILENT_MAX = REQUEST_TIMEOUT + 0.7  # generous for a busy machine; asking twice goes over it
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


async def _wait_for_go() -> None:
    """Block until the grader writes a line on stdin: the process is started ahead of its turn."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()


async def role_email_worker(env: LabEnv, learner: Any) -> None:
    """One incarnation of the email worker: waits for its turn, then runs until it is killed."""
    _add_effects(env)
    await _wait_for_go()
    await learner.email_worker(env)


# --- the lab notebook's playground --------------------------------------------------------------


async def _setup(js: Any, names: Any) -> None:
    # The platform team's part: the stream and both durables exist before any service starts.
    await provision(js, names, stream=STREAM, wildcard="orders.>", durable=EMAIL, subject=SUBJECT, ack_wait=ACK_WAIT)
    from nats.js.api import AckPolicy, ConsumerConfig

    config = ConsumerConfig(
        durable_name=names.durable(LOYALTY),
        filter_subject=names.subject(SUBJECT),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT,
    )
    await js.add_consumer(names.stream(STREAM), config)


def _order_id(data: bytes) -> str | None:
    """The order id an event or request carries: the order as JSON, {"id": ...}."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(body, dict):
        if isinstance(body.get("id"), str):
            return str(body["id"])
        inner = body.get("order")
        if isinstance(inner, dict) and isinstance(inner.get("id"), str):
            return str(inner["id"])
    return None


def _sku(data: bytes) -> str | None:
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    inner = body["order"] if isinstance(body.get("order"), dict) else body
    return str(inner["sku"]) if "sku" in inner else None


class PlaygroundShop:
    """The notebook's inventory and loyalty, each 'up', 'down' or 'silent'; `awarded` lists loyalty's points."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.states = {"inventory": "up", "loyalty": "up"}
        self.no_stock = {"sku-0"}  # ask for sku-0 to see an out-of-stock answer
        self.awarded: list[tuple[str, str]] = []  # (order id, "request" or "event")
        self._subs: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for service in self.states:
            await self.set(service, "up")
        self._task = asyncio.ensure_future(self._consume())

    async def set(self, service: str, state: str) -> None:
        """Take 'inventory' or 'loyalty' 'up', 'down' (nobody listens) or 'silent' (listens, never answers)."""
        if service not in self.states or state not in ("up", "down", "silent"):
            raise ValueError("set_service(service, state): service 'inventory' or 'loyalty', state up, down or silent")
        old = self._subs.pop(service, None)
        if old is not None:
            await old.unsubscribe()
        if state != "down":
            subject = self.env.subject(INVENTORY if service == "inventory" else LOYALTY_ASK)
            handler = self._inventory if service == "inventory" else self._loyalty
            self._subs[service] = await self.env.nc.subscribe(subject, cb=handler)
        self.states[service] = state
        await settle_subscriptions(self.env.nc)

    async def _inventory(self, msg: Any) -> None:
        if self.states["inventory"] != "up" or not msg.reply:
            return
        sku = _sku(msg.data)
        await msg.respond(json.dumps({"reserved": sku not in self.no_stock}).encode())

    async def _loyalty(self, msg: Any) -> None:
        if self.states["loyalty"] != "up":
            return
        oid = _order_id(msg.data) or "?"
        self.awarded.append((oid, "request"))
        print(f"loyalty: points awarded for {oid} (asked by request)")
        if msg.reply:
            await msg.respond(b'{"ok": true}')

    async def _consume(self) -> None:
        # The loyalty service's own durable: it reads every order event, at its own pace.
        try:
            sub = await self.env.js.pull_subscribe_bind(self.env.durable(LOYALTY), self.env.stream(STREAM))
            while True:
                if self.states["loyalty"] != "up":
                    await asyncio.sleep(0.2)
                    continue
                try:
                    msgs = await sub.fetch(20, timeout=0.5)
                except TimeoutError:
                    continue
                for msg in msgs:
                    self.awarded.append((_order_id(msg.data) or "?", "event"))
                    await msg.ack()
        except Exception:  # the playground was closed: the connection is gone
            return


async def playground(env: Any) -> None:
    """For the lab notebook: the stream and durables, inventory and loyalty, and effects that print."""
    await _setup(env.js, env.names)
    shop = PlaygroundShop(env)
    await shop.start()
    env.shop = shop
    env.set_service = shop.set
    env.save_order = lambda order: print(f"saved order {order['id']}")
    env.send_email = lambda order_id: print(f"email sent for {order_id}")


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
        crashes = [
            Crash("send_email", crash.randint(3, 4), kinds[0]),
            Crash("send_email", crash.randint(1, 3), kinds[1]),
        ]
        return cls(orders, middle, crashes)

    def by_role(self, role: str) -> list[Order]:
        return [o for o in self.orders if o.role == role]

    def one(self, role: str) -> Order:
        return self.by_role(role)[0]

    def get(self, oid: str) -> Order:
        return next(o for o in self.orders if o.id == oid)


# --- the course's services, played by the grader -------------------------------------------------


class Shop:
    """Inventory and loyalty as the grader runs them; every request they see is recorded."""

    def __init__(self, run: Run, plan: Plan) -> None:
        self.run = run
        self.by_sku = {o.sku: o.id for o in plan.orders}
        self.no_stock = {o.sku for o in plan.by_role("out_of_stock")}
        self.silent_skus = {o.sku for o in plan.by_role("inventory_silent")}
        self.silent_ids = {o.id for o in plan.by_role("loyalty_silent")}
        self.inventory_sub: Any = None
        self.loyalty_sub: Any = None
        self.task: asyncio.Task[None] | None = None
        self.stopping = False

    async def start(self) -> None:
        nc, names = self.run.nc, self.run.names
        self.inventory_sub = await nc.subscribe(names.subject(INVENTORY), cb=self._inventory)
        self.loyalty_sub = await nc.subscribe(names.subject(LOYALTY_ASK), cb=self._loyalty)
        sub = await self.run.js.pull_subscribe_bind(names.durable(LOYALTY), names.stream(STREAM))
        self.task = asyncio.ensure_future(self._consume(sub))
        await settle_subscriptions(nc)

    async def inventory_down(self) -> None:
        await self.inventory_sub.unsubscribe()
        self.inventory_sub = None
        await settle_subscriptions(self.run.nc)
        self.run.log.record("note", "inventory_down", None, role="inventory")

    async def inventory_up(self) -> None:
        self.inventory_sub = await self.run.nc.subscribe(self.run.names.subject(INVENTORY), cb=self._inventory)
        await settle_subscriptions(self.run.nc)
        self.run.log.record("note", "inventory_up", None, role="inventory")

    async def stop(self) -> None:
        # nats-py's fetch can swallow a cancellation, so the loop also checks a flag and the
        # wait is bounded: a grader must never hang on its own service.
        self.stopping = True
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=2.0)

    async def _inventory(self, msg: Any) -> None:
        sku = _sku(msg.data)
        oid = _order_id(msg.data) or self.by_sku.get(sku or "")
        log = self.run.log
        if sku in self.silent_skus:
            log.record("note", "inventory_ignored", oid, role="inventory", sku=sku)
            return  # silent: the request arrived and is dropped on the floor
        reserved = sku is not None and sku not in self.no_stock
        log.record("note", "inventory_answered", oid, role="inventory", sku=sku, reserved=reserved)
        if msg.reply:
            await msg.respond(json.dumps({"reserved": reserved}).encode())

    async def _loyalty(self, msg: Any) -> None:
        oid = _order_id(msg.data)
        if oid is None:
            self.run.log.record("note", "loyalty_unreadable", None, role="loyalty", data=msg.data[:80])
        elif oid in self.silent_ids:
            self.run.log.record("note", "loyalty_ignored", oid, role="loyalty")
            return
        else:
            self.run.log.record("effect", "award_points", oid, role="loyalty", via="request")
        if msg.reply:
            await msg.respond(b'{"ok": true}')

    async def _consume(self, sub: Any) -> None:
        # The loyalty service reads every order event from its own durable and acks each once done.
        while not self.stopping:
            try:
                msgs = await sub.fetch(50, timeout=0.2)
            except TimeoutError:
                continue
            except Exception:  # the run is over: the connection is closing
                return
            for msg in msgs:
                oid = _order_id(msg.data)
                seq = msg.metadata.sequence.stream
                if oid is None:
                    self.run.log.record("note", "loyalty_unreadable", None, role="loyalty", seq=seq, data=msg.data[:80])
                else:
                    self.run.log.record("effect", "award_points", oid, role="loyalty", via="event", seq=seq)
                with contextlib.suppress(Exception):
                    await msg.ack_sync()


class Stream:
    """The stream ORDERS as the grader reads it: which events it holds, and for which orders."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.events: dict[int, tuple[str, str | None, float]] = {}  # seq -> (subject, order id, first seen)
        self.scanned = 0
        self._lock = asyncio.Lock()

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
                self.events[seq] = (raw.subject or "", _order_id(raw.data or b""), time.time())
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


@dataclass
class Workers:
    """The email worker's incarnations, started ahead of their turn and released one at a time."""

    children: list[Child] = field(default_factory=list)
    released: dict[int, float] = field(default_factory=dict)  # pid -> when

    async def release(self, child: Child) -> None:
        assert child.proc.stdin is not None
        with contextlib.suppress(ConnectionError, RuntimeError):
            child.proc.stdin.write(b"go\n")
            await child.proc.stdin.drain()
        self.released[child.pid] = time.time()

    def label(self, pid: int) -> str:
        for n, child in enumerate(self.children, 1):
            if child.pid == pid:
                return f"email worker #{n} (pid {pid})"
        return f"process {pid}"


class OrderDesk:
    """The order-service processes: calls one order at a time, restarts a process the grader stopped."""

    def __init__(self, run: Run, children: dict[str, Child], workers: Workers, stream: Stream) -> None:
        self.run = run
        self.children = children
        self.workers = workers
        self.stream = stream
        self.hung = 0

    async def place(self, order: Order) -> Order:
        up = any(c.alive and c.pid in self.workers.released for c in self.workers.children)
        order.email_state = "up" if up else "down"
        order.started = order.ended = time.time()
        if self.hung >= MAX_HUNG:
            order.skipped = True
            return order
        child = self.children[order.service]
        if not child.alive:  # stopped for a hung call: a fresh process for the next order
            child = self.children[order.service] = await self.run.spawn("orders", params=PARAMS)
        order.started = time.time()
        order.reply = await child.call("place_order", CALL_DEADLINE, order=order.body)
        order.ended = time.time()
        self.hung += order.reply.hung
        await self.stream.scan()  # so a trace can say when its event was first seen in the stream
        return order


# --- the grader ----------------------------------------------------------------------------------


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    plan = Plan.draw(run.seed)
    await _setup(run.js, run.names)
    shop = Shop(run, plan)
    stream = Stream(run)
    watch = await BrokerWatch(run.names.stream(STREAM), run.names.durable(EMAIL)).start(run.nc)
    await shop.start()
    spawned = await asyncio.gather(
        run.spawn("orders", params=PARAMS),
        run.spawn("orders", params=PARAMS),
        *(run.spawn("email_worker", faults=[crash], params=PARAMS) for crash in plan.crashes),
        run.spawn("email_worker", params=PARAMS),
    )
    service_a, service_b, *incarnations = spawned
    workers = Workers(list(incarnations))
    w1, w2, w3 = incarnations
    desk = OrderDesk(run, {"A": service_a, "B": service_b}, workers, stream)
    try:
        return await _run(run, plan, shop, stream, watch, workers, desk, (w1, w2, w3))
    finally:
        await shop.stop()
        await watch.stop()


async def _run(
    run: Run,
    plan: Plan,
    shop: Shop,
    stream: Stream,
    watch: BrokerWatch,
    workers: Workers,
    desk: OrderDesk,
    incarnations: tuple[Child, Child, Child],
) -> list[Check]:
    w1, w2, w3 = incarnations

    async def email_consumer() -> Any:
        return await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(EMAIL))

    async def drained(durable: str) -> bool:
        await stream.scan()
        info = await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(durable))
        return bool(
            info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq >= stream.last_placed
        )

    def decided() -> bool:
        """An email went out more often than the crashes allow: waiting longer only adds more."""
        return any(_email_excess(run, watch, stream, settled=False).values())

    async def crash_or_idle(child: Child) -> None:
        """Wait for the child's planned crash, unless it can no longer come (nothing left for it to email)."""

        async def over() -> bool:
            return not child.alive or decided() or await drained(EMAIL)

        await run.wait_for(over, CRASH_DEADLINE)
        if child.alive:
            await child.kill()

    # 1-2: every service up, then the email worker down; the two extras fall where the seed put them.
    await workers.release(w1)
    # A worker on the durable shows it is running with its first pull; a worker of another kind
    # shows nothing the grader can see, so it gets a moment to subscribe before the first order.
    await run.wait_for(lambda: bool(watch.pulls) or not w1.alive, W1_SETTLE)
    for step in [o.id for o in plan.orders[:2]] + plan.middle:
        if step == "WAIT":
            await crash_or_idle(w1)
            continue
        order = plan.get(step)
        if order.role == "stream_refused":
            await stream.scan()
            async with refuse_publishes(run.js, run.names.stream(STREAM)):
                await desk.place(order)
                await stream.scan()  # while still refusing: nothing can have been added since
                run.log.record("note", "refused_window_checked", order.id, present=bool(stream.seqs(order.id)))
        else:
            await desk.place(order)
        if w1.alive and order.accepted:
            # One order at a time for email worker #1: its planned crash then falls on the same order
            # on every replay of a seed, whatever its batch size.
            await run.wait_for(_emailed_or_gone(run, order.id, w1), SERIAL_WAIT)
    # 3: inventory down.
    await shop.inventory_down()
    await desk.place(plan.one("inventory_down"))
    await shop.inventory_up()
    # 4: email worker #2, and meanwhile an order the inventory never answers, in the other process.
    silent = asyncio.ensure_future(desk.place(plan.one("inventory_silent")))
    await workers.release(w2)
    await crash_or_idle(w2)
    # 5: email worker #3 catches up; then a quiet spell; then the late order.
    await workers.release(w3)

    def unread() -> bool:
        """No worker has ever asked the durable for events, long after the last one started."""
        return not watch.pulls and time.time() - workers.released[w3.pid] > FIRST_PULL

    async def caught_up() -> bool:
        return decided() or unread() or await drained(EMAIL)

    was_drained = await run.wait_for(caught_up, CATCH_UP) and await drained(EMAIL)
    idle = await _wait_idle(run, watch, w3) if was_drained else IdleEvidence(drained=False)
    late = plan.one("late")
    await desk.place(late)
    await run.wait_for(lambda: bool(_emails(run).get(late.id)) or not w3.alive, LATE_DEADLINE)
    await silent

    async def settled() -> bool:
        return decided() or unread() or (await drained(EMAIL) and await drained(LOYALTY))

    await run.wait_for(settled, SETTLE)
    await stream.scan()
    info = await email_consumer()
    return judge(run, plan, stream, watch, workers, info, idle)


def _emailed_or_gone(run: Run, oid: str, worker: Child) -> Callable[[], bool]:
    return lambda: oid in _emails(run) or not worker.alive


@dataclass
class IdleEvidence:
    """What the broker showed of the last worker after the durable drained."""

    drained: bool
    since: float = 0.0  # the last ack before the quiet spell
    waited: Any = None  # a pull after `since` that waited out its expiry (observe.Pull)
    again: Any = None  # the pull that came after it
    last_pull: Any = None  # the last pull seen, if the worker never asked again


async def _wait_idle(run: Run, watch: BrokerWatch, worker: Child) -> IdleEvidence:
    """Wait until the worker has survived an empty fetch: a pull that waited out its expiry, then another."""
    since = watch.acks[-1].ts if watch.acks else time.time()
    evidence = IdleEvidence(drained=True, since=since)
    started = time.monotonic()

    def first() -> Any:
        return next((p for p in watch.pulls if p.ts >= since and p.expires > 0), None)

    if await run.wait_for(lambda: first() is not None or not worker.alive, FIRST_PULL) and first() is not None:
        pull = first()
        budget = min(pull.expires + IDLE_MARGIN, IDLE_CAP - (time.monotonic() - started))
        await run.wait_for(lambda: watch.refetched_after_idle(since) is not None or not worker.alive, budget)
    again = watch.refetched_after_idle(since)
    if again is not None:
        evidence.again = again
        evidence.waited = next(
            (
                p
                for p in watch.pulls
                if since <= p.ts < again.ts and p.expires > 0 and again.ts >= p.ts + p.expires * 0.95
            ),
            None,
        )
    evidence.last_pull = watch.pulls[-1] if watch.pulls else None
    return evidence


# --- evidence helpers --------------------------------------------------------------------------------


def _emails(run: Run) -> dict[str, list[Any]]:
    by_order: dict[str, list[Any]] = {}
    for event in run.log.events("effect", "send_email"):
        by_order.setdefault(event.key or "", []).append(event)
    return by_order


def _awards(run: Run) -> dict[str, list[Any]]:
    by_order: dict[str, list[Any]] = {}
    for event in run.log.events("effect", "award_points"):
        by_order.setdefault(event.key or "", []).append(event)
    return by_order


@dataclass
class Allowance:
    """How often an order may be emailed, and the broker's evidence for it."""

    allowed: int
    kills: list[str]  # one phrase per worker killed after emailing it, before any ack of it reached the broker
    deliveries: int | None  # the most deliveries of it the durable reported in acks; None: no ack to tell


def _allowance(run: Run, watch: BrokerWatch, stream: Stream, oid: str) -> Allowance:
    """Once, plus once per worker the nemesis killed after it emailed the order, before its ack.

    The evidence is the broker's: such a worker held a delivery the broker had no ack for, so the
    event comes back. The allowance never exceeds the deliveries the durable itself reported (the
    `delivered` count of the acks it received); a durable nobody ever asked delivered nothing.
    """
    kills = {e.pid: e for e in run.log.events("crash", "send_email")}
    emails = _emails(run).get(oid, [])
    seqs = stream.seqs(oid)
    held: list[str] = []
    for pid in dict.fromkeys(e.pid for e in emails):
        kill = kills.get(pid)
        last = [e for e in emails if e.pid == pid][-1]
        if kill is None or kill.ts < last.ts or any(watch.acked(s, before=kill.ts) for s in seqs):
            continue
        held.append(f"pid {pid} was SIGKILLed after emailing it, before any ack of it reached the broker")
    acks = [a for s in seqs for a in watch.of(s)]
    deliveries = max(a.delivered for a in acks) if acks else (None if watch.pulls else 0)
    allowed = 1 + len(held) if deliveries is None else max(1, min(1 + len(held), deliveries))
    return Allowance(allowed, held, deliveries)


def _email_excess(run: Run, watch: BrokerWatch, stream: Stream, *, settled: bool = True) -> dict[str, int]:
    """Orders emailed more often than the evidence allows, and by how much.

    While the run goes on (`settled=False`) the ack of a legitimate redelivery may still be on its
    way, so only the kills count there: an excess then is already certain.
    """
    excess = {}
    for oid, events in _emails(run).items():
        allowance = _allowance(run, watch, stream, oid)
        limit = allowance.allowed if settled else 1 + len(allowance.kills)
        if len(events) > limit:
            excess[oid] = len(events) - limit
    return excess


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _of(some: list[Any], all_: list[Any], noun: str, be: bool = True) -> str:
    """'1 of 8 accepted orders was' / '2 of 8 accepted orders were' (without the verb if not `be`)."""
    verb = (" was" if len(some) == 1 else " were") if be else ""
    return f"{len(some)} of {_plural(len(all_), noun)}{verb}"


@dataclass
class Evidence:
    """Everything judged, and a story per order for the traces."""

    run: Run
    plan: Plan
    stream: Stream
    watch: BrokerWatch
    workers: Workers
    info: Any
    idle: IdleEvidence

    def at(self, ts: float) -> str:
        return self.run.at(ts)

    def notes(self, name: str, oid: str) -> list[Any]:
        return [e for e in self.run.log.events("note", name) if e.key == oid]

    def trace(self, oid: str) -> list[str]:
        """What happened to one order, in time order, one line each."""
        order = self.plan.get(oid)
        steps: list[tuple[float, str]] = []
        if order.reply is not None:
            words = ROLE_WORDS[order.role]
            steps.append((order.started, f"{oid} {words} (email worker {order.email_state})"))
            steps.append((order.ended, f"place_order {order.outcome()}"))
        for e in self.notes("inventory_answered", oid):
            steps.append((e.ts, f"inventory answered reserved={str(e.detail.get('reserved')).lower()}"))
        for e in self.notes("inventory_ignored", oid):
            steps.append((e.ts, "inventory received the request and never answered (silent)"))
        for e in self.notes("loyalty_ignored", oid):
            steps.append((e.ts, "loyalty received a request and never answered (silent)"))
        for e in self.run.log.events("effect", "save_order"):
            if e.key == oid:
                steps.append((e.ts, f"saved by the order service (pid {e.pid})"))
        for seq in self.stream.seqs(oid):
            first_seen = self.stream.events[seq][2]
            steps.append((first_seen, f"its event is in the stream at seq {seq} (seen by the grader)"))
            for ack in self.watch.of(seq):
                what = f"by now the broker has the worker's {ack.kind} for seq {seq} (delivery {ack.delivered})"
                steps.append((ack.ts, what))
        for e in self.run.log.events("crash", "send_email"):
            if e.key == oid:
                moment = "before the email went out" if e.detail.get("when") == "before" else "right after the email"
                steps.append((e.ts, f"{self.workers.label(e.pid)} SIGKILLed {moment} (injected)"))
        for e in _emails(self.run).get(oid, []):
            steps.append((e.ts, f"emailed by {self.workers.label(e.pid)}"))
        for e in _awards(self.run).get(oid, []):
            how = (
                "when place_order asked it" if e.detail.get("via") == "request" else f"from event seq {e.detail['seq']}"
            )
            steps.append((e.ts, f"loyalty awarded points {how}"))
        return [f"{self.at(ts)} {text}" for ts, text in sorted(steps, key=lambda s: s[0])]


def judge(
    run: Run, plan: Plan, stream: Stream, watch: BrokerWatch, workers: Workers, info: Any, idle: IdleEvidence
) -> list[Check]:
    ev = Evidence(run, plan, stream, watch, workers, info, idle)
    crash_at = _first_crash(run)
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
        _acked_check(ev),
        _loyalty_check(ev),
        _idle_check(ev),
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
            f"could not be tested: the {_plural(len(refused), 'order')} meant to be {situation} "
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
        f"{len(refused)} of {_plural(len(group), 'order')} {situation} {'was' if len(refused) == 1 else 'were'} "
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
        note = (
            f"{ev.workers.label(c.pid)} had been SIGKILLed at {ev.at(c.ts)} "
            f"(injected, at its email #{c.detail['call']})."
        )
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
    if check.passed and order.elapsed > SILENT_MAX:
        return Check(
            name,
            title,
            False,
            f"{order.id} was {situation}: place_order raised InventoryUnavailable after {order.elapsed:.2f} s "
            f"(allowed {SILENT_MAX:.1f} s): the customer waited longer than env.request_timeout.",
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
        f"{_plural(len(missing), 'accepted order')} {'has' if len(missing) == 1 else 'have'} no event on "
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
        reached.append(f"emailed by {ev.workers.label(emails[order.id][0].pid)} at {ev.at(emails[order.id][0].ts)}")
    if order.id in awards:
        reached.append(f"given loyalty points at {ev.at(awards[order.id][0].ts)}")
    told = "never heard back" if order.kind == "hung" else "was told no"
    message = (
        f"{_plural(len(announced), 'order')} not accepted reached a reacting service: {order.id} "
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
            f"email for it ever went out: it was acked before its email, and {ev.workers.label(crash.pid)} was "
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
    w3 = ev.workers.children[-1]
    if w3.died or w3.returned:
        message += f"\nThe last email worker {w3.how_it_ended()}, so nothing emailed what was left."
        if ev.info.num_pending or ev.info.num_ack_pending:
            hint = "a worker runs until it is stopped: nothing about one event is a reason to end it"
    return Check("no_lost_emails", title, False, message, trace=[*ev.trace(order.id), "never emailed"], hint=hint)


def _duplicate_check(ev: Evidence) -> Check:
    title = "no order is emailed twice, except where a worker was killed before its ack"
    emails = _emails(ev.run)
    extra = _email_excess(ev.run, ev.watch, ev.stream)
    if not extra:
        return Check("no_duplicate_emails", title, True)
    oid = next(iter(extra))
    sent = emails[oid]
    allowance = _allowance(ev.run, ev.watch, ev.stream, oid)
    who = ", ".join(dict.fromkeys(ev.workers.label(e.pid) for e in sent))
    counted = allowance.deliveries is None or 1 + len(allowance.kills) <= allowance.deliveries
    why = f" ({'; '.join(allowance.kills)})" if allowance.kills and counted else ""
    message = (
        f"{_plural(len(extra), 'order')} emailed more often than the crashes explain: {oid} {len(sent)} times "
        f"(by {who}); allowed {allowance.allowed}{why}."
    )
    if allowance.deliveries == 0:
        message += (
            f"\nThe durable '{EMAIL}' never delivered {oid}: no worker ever asked it for events. A consumer of your "
            "own starts again from the start of the stream each time a worker restarts."
        )
        hint = f"bind the email worker to the durable env.durable('{EMAIL}'): it remembers what was acked"
    elif allowance.deliveries is None:
        message += (
            f"\nNo ack for {oid} ever reached the broker, so it delivered the event again after every ack_wait "
            f"({ACK_WAIT:.1f} s) while a worker was alive, not only after a crash."
        )
        hint = "ack every event once its email went out; an un-acked event comes back after ack_wait"
    elif allowance.deliveries < len(sent):
        deliveries = "1 delivery" if allowance.deliveries == 1 else f"{allowance.deliveries} deliveries"
        message += (
            f"\nThe acks the durable '{EMAIL}' received show {deliveries} of {oid}, yet it was emailed {len(sent)} "
            "times: some deliveries were emailed more than once, or came from a consumer of your own."
        )
        hint = f"email each event you take from the durable env.durable('{EMAIL}') once, then ack it"
    else:
        message += (
            f"\nThe broker delivered it again because no ack came within ack_wait ({ACK_WAIT:.1f} s) while the "
            "worker was alive, not because a crash interrupted it."
        )
        hint = "ack every event once its email went out; an un-acked event comes back after ack_wait"
    return Check("no_duplicate_emails", title, False, message, trace=ev.trace(oid), hint=hint)


def _acked_check(ev: Evidence) -> Check:
    title = f"every order event is acked on the durable '{EMAIL}' (nothing stuck)"
    info = ev.info
    if info.num_pending == 0 and info.num_ack_pending == 0:
        return Check("all_acked", title, True)
    message = (
        f"the durable '{EMAIL}' still has {info.num_pending} undelivered and {info.num_ack_pending} "
        f"delivered-but-unacked events ({info.num_redelivered} redelivered) after the run."
    )
    acks = [a for a in ev.watch.acks if a.kind == "ack"]
    if not ev.watch.pulls:
        message += " No worker ever asked it for events: it was not read at all."
        hint = f"read from the durable env.durable('{EMAIL}') on env.stream('{STREAM}'): it exists already"
    elif not acks:
        message += " The broker never received an ack on it: every event comes back after ack_wait, forever."
        hint = "ack each event once its email went out"
    else:
        hint = "ack each event once its email went out, and keep consuming until every event is acked"
    w3 = ev.workers.children[-1]
    if ev.watch.pulls and (w3.died or w3.returned):
        message += f" The last email worker {w3.how_it_ended()}."
        hint = "a worker runs until it is stopped: nothing about one event is a reason to end it"
    return Check("all_acked", title, False, message, hint=hint)


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
            f"{_plural(len(twice), 'accepted order')} reached loyalty more than once: {order.id} "
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
    title = "the running email worker survives a quiet spell and emails a late order itself"
    name = "worker_survives_idle"
    idle, late = ev.idle, ev.plan.one("late")
    w3 = ev.workers.children[-1]
    label = ev.workers.label(w3.pid)
    sent = _emails(ev.run).get(late.id, [])
    by_w3 = [e for e in sent if e.pid == w3.pid]
    if idle.again is not None and by_w3 and late.accepted:
        return Check(name, title, True)
    hint = "a worker runs until it is stopped: an empty fetch means 'nothing yet', so ask again"
    if not idle.drained:
        message = (
            f"could not be tested: the durable '{EMAIL}' never emptied ({ev.info.num_pending} undelivered, "
            f"{ev.info.num_ack_pending} unacked at the end), so {label} never had a quiet spell. Fix the other "
            "email checks first."
        )
        return Check(
            name, title, False, message, hint="every event must be emailed and acked before the worker can go idle"
        )
    if idle.again is None:
        if not w3.alive and w3.killed != "grader":
            message = f"after the durable drained at {ev.at(idle.since)}, {label} {w3.how_it_ended()}."
        elif idle.last_pull is None:
            message = (
                f"{label} never asked the durable '{EMAIL}' for events: no pull request reached it in the whole run, "
                "so the grader could not see it wait through a quiet spell."
            )
            hint = (
                f"the email worker reads the durable env.durable('{EMAIL}'), "
                "and asks again whenever a fetch comes back empty"
            )
        elif idle.last_pull.ts < idle.since:
            message = (
                f"after the durable drained at {ev.at(idle.since)}, {label} sent no pull request at all within "
                f"{FIRST_PULL:.1f} s: it stopped asking for events."
            )
        else:
            p = idle.last_pull
            message = (
                f"after the durable drained at {ev.at(idle.since)}, {label}'s pull at {ev.at(p.ts)} "
                f"(wait up to {p.expires:.2f} s) was never followed by another: it did not ask again after an "
                "empty fetch."
            )
            if p.expires == 0:
                message = (
                    f"after the durable drained at {ev.at(idle.since)}, {label}'s pull requests carried no expiry, "
                    "so the grader could not see it wait out an empty fetch."
                )
                hint = "fetch with a timeout, and ask again when it expires empty"
        return Check(name, title, False, message, trace=ev.trace(late.id), hint=hint)
    waited, again = idle.waited or idle.again, idle.again
    survived = (
        f"{label} survived an empty fetch (its pull at {ev.at(waited.ts)} waited {waited.expires:.2f} s for nothing; "
        f"it asked again at {ev.at(again.ts)})"
    )
    if late.skipped:
        message = f"could not be tested: {survived}, but the late order {late.id} {late.outcome()}."
        return Check(name, title, False, message, hint="fix the hung orders first")
    if late.accepted and not ev.stream.seqs(late.id):
        message = (
            f"could not be tested: {survived}, but the late order {late.id} has no event on {ev.stream.placed} for it "
            "to read (see the check on accepted orders and the stream)."
        )
        return Check(name, title, False, message, trace=ev.trace(late.id), hint="announce every accepted order first")
    if not late.accepted:
        message = (
            f"could not be tested: {survived}, but place_order refused the late order {late.id}: {late.outcome()}."
        )
        return Check(name, title, False, message, trace=ev.trace(late.id), hint="fix the acceptance checks first")
    if by_w3:
        return Check(name, title, True)
    if sent:
        message = f"{survived}; then {late.id} was placed, and emailed by {ev.workers.label(sent[0].pid)}, not by it."
    elif not w3.alive:
        message = f"{survived}; then {late.id} was placed, and {label} {w3.how_it_ended()} without emailing it."
    else:
        message = f"{survived}; then {late.id} was placed, and not emailed within {LATE_DEADLINE:.0f} s."
    return Check(name, title, False, message, trace=ev.trace(late.id), hint=hint)
