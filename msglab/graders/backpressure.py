"""Lab 05 grader: a queue-age monitor, and an order intake that says "busy" instead of a promise it cannot keep.

The shop (played by the grader, out of the learner's reach): the stream ORDERS (`orders.>`), which
also stores `orders.cancelled` events that the fulfilment durable 'fulfil' does not read, and the
fulfilment workers on that durable (msglab.world.fulfilment's pool, the lesson's own, as tasks of the
grader's, so it knows to the millisecond when each order was acked). The learner's file runs in three
processes: a monitor (the grader samples `queue_age` and `queue_status` about every 50 ms, all run
long) and two intake processes (`place_order`; A is SIGKILLed right after it answered "accepted" for
its k-th order, B takes over).

Workload (seeded), each phase ended by what the grader sees, with a cap:
  0. quiet: nothing waits; `orders.cancelled` events arrive every 0.1 s from here on, the first one well
     over the budget's age before phase 1;
  1. deep but fast: the workers stop, an import of 200-300 orders lands at once, the monitor is
     sampled (the queue is deep, its oldest order a few ms old), then eight workers drain it in a moment
     (no order is placed: what the intake answers on a queue whose workers are stalled is not judged);
     calm: once a cancellation stored after the last ack is QUIET old, orders are placed through
     intake A one at a time, each on a drained queue, until A was SIGKILLed right after its k-th
     acceptance (k from the seed, 4-9), at most k + CALM_SPARE orders; B takes every later order, so
     where the kill lands follows from the plan, never from how many orders an earlier phase's pace
     let A accept (rule 1 says what A answered instead, should it not fire);
  2. the rush ("over capacity"): one slow worker (80 ms an order) while customers place an order every
     15 ms or so (about two to five times as fast), until the intake has refused ten orders; then the
     worker keeps its pace until each order accepted here is finished or has surely waited too long;
  3. stall: the workers stop; orders keep coming until the queue age is well over the budget;
  4. scale up: six workers drain the backlog; orders keep coming until the age has fallen back;
     keeping up: eight workers take the grader's own orders (10 ms each, one every 4 ms, so a few are
     always in hand and none waits long) while 20 customers come, one every 40 ms: every order there
     meets a young, short queue (a refusal there is needless, clearly, on every run);
     then the stream refuses every publish (full, discard-new) for 2-4 orders, and accepts again;
     then, twice (in an order from the seed), once the stream holds every order accepted so far (not
     started when one is still missing after 3 s), the stream goes silent and orders are placed until
     one's publish reaches it (up to 3 s): it stores that order without confirming it, or, full, refuses
     it without saying so; it answers again once the grader has seen the publish (stored, or tried again);
  5. shallow but stuck: two workers keep up with a trickle of orders, but one order is held by a
     worker that hangs on it, until its age is well over the budget; then it is let go;
  6. eight workers drain everything.

Invariants, judged against the grader's own record of when each order was stored (the stream's
timestamps) and acked (sent and confirmed, by its own workers), never against what the learner
prints: the reported age lies between the least and the most the true age could have been while the
call ran (plus 80 ms); a deep queue with a young head is never ERROR, a shallow queue with an old
head is ERROR; the status follows the rule in the README for every window it is given; an order is
refused while the age is clearly over the budget; every order accepted in the rush is finished within
the budget (plus a tolerance): the promise itself, so the lesson's admission check (refuse once the age
is over the budget) fails and the learner chooses the signal (a forecast, depth over drain rate, or the
age with a margin); no order is refused while the queue is young and short; orders are never answered
with an exception, always refused while the stream is full; every accepted order is in the stream
and processed, also the one accepted right before the SIGKILL. The status rule and the age
measurement are the world's (msglab.world.fulfilment), the ones the lesson teaches. Rule 1 (the
SIGKILL fired) is worded from the labels on intake A's Crash. The kill lands on the workload (issue
15): each order is registered as it is placed, the intake's answers are judged by it, so an answer
about an order nobody placed never takes the kill, and effects_on_the_workload names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError

from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import refuse_publishes
from msglab.grading.rules import Planned, plural
from msglab.grading.scaffold import Phases, Topology
from msglab.grading.verdict import Check
from msglab.world.fulfilment import Fulfilment, Handled, Sample, depth_and_age, order_id
from msglab.world.fulfilment import status as expected_status  # the README's rule, as the lesson shows it

if TYPE_CHECKING:  # the learner's processes import this module too: they need none of the grader's side
    from msglab.grading.harness import Child, Reply, Run

SUBJECT = "orders.placed"  # what the durable delivers
CANCELLED = "orders.cancelled"  # stored in the same stream, read by nobody here
ACK_WAIT = 30.0  # seconds; long, so no order is delivered twice while the grader holds or stalls it
TOPOLOGY = Topology("ORDERS", "orders.>", "fulfil", SUBJECT, ACK_WAIT, consumer={"max_ack_pending": 1000})
STREAM, DURABLE = TOPOLOGY.stream, TOPOLOGY.durable  # the contract: what the learner's permissions protect
LEARNER_SUBJECTS = [SUBJECT]  # the intake publishes orders; everything else is the JetStream API on ORDERS
BUDGET = 0.5  # env.age_budget: the promise "handled within half a second" (production: minutes)
WINDOW = 0.25  # env.trend_window: queue_status is given the samples of the last quarter second
PARAMS = {"age_budget": BUDGET, "trend_window": WINDOW}
AGE_TOLERANCE = 0.08  # a reported age may be this far outside what the true age could have been
CLEAR = 0.15  # "clearly" under or over the budget, for the monitor's status
INTAKE_CLEAR = 0.1  # ... and for the intake's answers
DEEP, SHALLOW = 100, 5  # a deep queue holds at least this many orders; a shallow one at most this many
CALL_DEADLINE = 3.0  # after this the grader declares a call hung and stops the process (calls take ms)
SAMPLE_GAP = 0.05  # pause between two monitor samples
ORDER_GAP = 0.02  # pause between two orders placed by the customers
# ... in phase 2 (the rush): orders come 2-5 times as fast as the slow worker finishes them. Counted from the last
# placement, a gap of 15 ms let an idle machine place 60 a second (5.5 times the worker: the README's bound, which
# the learner's margin of budget / 4 relies on); 20 ms keeps the 45-50 a second an answer plus 15 ms used to give.
RUSH_GAP = 0.02
WORK_SLOW = 0.08  # seconds the one worker of phase 2 spends on an order
PROMISE_TOL = 0.25  # an order accepted in the rush may be finished this long after the budget, not later
SETTLE_MARGIN = 0.25  # the slow worker stays until each order accepted in the rush is acked, or this far past that
RUSH_REFUSALS = 10  # the rush goes on until the intake has refused this many orders (or PHASE_CAP)
SPARE = BUDGET / 2  # a refusal is needless when every order ahead of it was finished within this ...
YOUNG = BUDGET / 10  # ... and the oldest of them had waited at most this (a margin of the age is the learner's)
# A policy refuses needlessly again and again (wrong files: 10-44 a run); a forecast misled once by a drain rate
# measured while the machine starved its processes refused 2 (the solution, every core busy): judged from this many.
NEEDLESS_MIN = 5
CANCEL_EVERY = 0.1
# The calm step: intake A takes orders one at a time, each on an empty queue, until its planned kill fired; at most
# this many more than the kill counts (an intake that refuses an empty queue never reaches it: rule 1 says so).
CALM_SPARE = 6
# Keeping up: eight workers spend KEEP_WORK on each of the grader's own orders, published every KEEP_GAP, so a few are
# always in hand and none waits long; KEEP_ORDERS customers come, one every KEEP_ORDER_GAP. Each order placed there
# meets a queue that is never empty and always young: an intake that refuses while anything is unfinished refuses
# each one (clearly needless, many times NEEDLESS_MIN), one that forecasts or keeps a margin accepts.
KEEP_WORK, KEEP_GAP, KEEP_ORDERS, KEEP_ORDER_GAP = 0.01, 0.004, 20, 0.04
# Phase 0 lasts until the first cancellation has been in the stream this long: from then on a monitor that counts
# the stream's first message, or a cancellation, reads clearly over the budget, so the deep-but-fast moment after it
# judges such a monitor the same way on every run, whenever the moment's samples land.
QUIET = BUDGET + CLEAR
PHASE_CAP = 3.0  # no phase waits longer than this for its condition
STATUSES = ("OK", "WARNING", "ERROR")
# A publish whose confirmation never comes, both ways, on every seed: "reply", the stream stores the order and
# sends no confirmation (its no_ack, for a moment); "request", the stream is full and its refusal is not sent either.
LOST_KINDS = ("reply", "request")
ACCEPTED, BUSY = "accepted", "busy"
OUTCOMES = (ACCEPTED, BUSY, "failed", "other")  # the intake's answers, each an effect call about the order placed


def _borderline(samples: list[Sample], budget: float) -> bool:
    """Too close to a boundary of the rule for rounding not to decide it: not judged."""
    newest = samples[-1]
    if abs(newest.age - budget) <= 1e-6 * max(1.0, budget):
        return True
    span = newest.t - samples[0].t
    return len(samples) >= 2 and abs((newest.age - samples[0].age) - 0.5 * span) <= 1e-6 * max(1.0, span)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


# --- what runs inside the learner's processes ------------------------------------------------


def _depth_reader(env: Any) -> Any:
    async def depth() -> int:
        info = await env.js.consumer_info(env.stream(STREAM), env.durable(DURABLE))
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    return depth


def ops_monitor(env: Any, learner: Any) -> dict[str, Any]:
    """The monitor: each `sample` measures the age (yours) and the depth (the course's), then asks your status."""
    from msglab.grading.runner import describe

    source = os.environ.get("MSGLAB_SOURCE", "")
    history: list[Sample] = []
    depth = _depth_reader(env)
    env.Sample = Sample

    async def sample() -> dict[str, Any]:
        try:
            raw = await learner.queue_age(env)
        except Exception as exc:
            return {"failed": "queue_age", **describe(exc, source)}
        age = _number(raw)
        if age is None:
            return {"failed": "queue_age", "error": "", "message": f"queue_age returned {raw!r}, not a number"}
        now = time.time()
        history.append(Sample(now, age, await depth()))
        del history[: max(0, len(history) - 200)]
        window = [s for s in history if s.t >= now - WINDOW]
        try:
            status = learner.queue_status(list(window), BUDGET)
        except Exception as exc:
            return {"failed": "queue_status", "age": age, "window": [list(s) for s in window], **describe(exc, source)}
        return {"age": age, "status": status if isinstance(status, str) else repr(status),
                "window": [list(s) for s in window]}  # fmt: skip

    async def status(samples: list[list[float]], budget: float) -> Any:
        value = learner.queue_status([Sample(float(t), float(a), int(d)) for t, a, d in samples], budget)
        return value if isinstance(value, str) else repr(value)

    return {"sample": sample, "status": status}


def ops_intake(env: Any, learner: Any) -> dict[str, Any]:
    """The order intake: the grader places one order at a time; each answer is told to the grader at once.

    The answer is an effect the grader records before anything else runs in this process, so a
    SIGKILL planned "after accepted" lands right after the customer was told "accepted".
    """
    from msglab.grading.runner import describe

    source = os.environ.get("MSGLAB_SOURCE", "")

    async def place_order(order: dict[str, Any]) -> dict[str, Any]:
        oid = str(order.get("id"))
        try:
            result = await learner.place_order(env, order)
        except Exception as exc:
            info = describe(exc, source)
            env.world.call("failed", oid, **info)
            return {"outcome": "failed", **info}
        if result == ACCEPTED:
            env.world.call("accepted", oid)
            return {"outcome": ACCEPTED}
        if result == BUSY:
            env.world.call("busy", oid)
            return {"outcome": BUSY}
        env.world.call("other", oid, value=repr(result)[:200])
        return {"outcome": "other", "value": repr(result)[:200]}

    return {"place_order": place_order}


# --- the lab notebook's playground ---------------------------------------------------------------


async def playground(env: Any) -> None:
    """For the lab notebook: the stream, the durable, and two fulfilment workers in the notebook's process.

    env.workers.scale(0) stalls them, env.workers.scale(4, work=0.01) brings four back;
    env.Sample builds the samples queue_status takes.
    """
    await TOPOLOGY.provision(env.js, env.names)
    env.workers = await Fulfilment(env.js, env.stream(STREAM), env.durable(DURABLE)).start(2, 0.02)
    env.Sample = Sample


# --- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    burst: int  # orders in the deep-but-fast import
    kill_at: int  # intake A is SIGKILLed right after its k-th "accepted"
    refused: int  # orders placed while the stream refuses publishes
    budgets: tuple[float, ...]  # budgets for the synthetic status windows
    lost: tuple[str, ...] = LOST_KINDS  # the two lost confirmations, in this order

    @classmethod
    def draw(cls, seed: int) -> Plan:
        r = rng(seed, "plan")
        # kill_at counts intake A's acceptances, all in the calm step (A takes no other order).
        burst, kill_at, refused = r.randint(200, 300), r.randint(4, 9), r.randint(2, 4)
        budgets = (0.5, r.choice([2.0, 5.0]), 300.0)
        return cls(burst, kill_at, refused, budgets, tuple(r.sample(LOST_KINDS, 2)))

    def crash(self) -> Crash:
        """Intake A's SIGKILL, right after its k-th ACCEPTED, worded for rule 1 should it not fire."""
        nth = _nth(self.kill_at)
        return Crash(
            ACCEPTED, self.kill_at, "after", point=f"right after it answered ACCEPTED for the {nth} time",
            counted="ACCEPTED answer",
            hint="accept orders while the queue's age is under the budget: the kill comes right after an acceptance",
        )  # fmt: skip


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def status_cases(plan: Plan) -> list[tuple[str, list[Sample], float, str]]:
    """Windows with a known status, far from every boundary: (what it shows, samples, budget, expected)."""
    cases = []
    for budget in plan.budgets:
        b = budget
        cases += [
            ("an empty queue", [Sample(0, 0, 0), Sample(0.5 * b, 0, 0), Sample(b, 0, 0)], b, "OK"),
            ("a deep queue whose oldest order is young and getting younger",
             [Sample(0, 0.1 * b, 900), Sample(0.5 * b, 0.08 * b, 600), Sample(b, 0.05 * b, 300)], b, "OK"),
            ("one stuck order, depth 1, its age over the budget",
             [Sample(0, 0.6 * b, 1), Sample(0.5 * b, 1.1 * b, 1), Sample(b, 1.6 * b, 1)], b, "ERROR"),
            ("one stuck order, depth 1, its age under the budget but growing as fast as the clock",
             [Sample(0, 0.05 * b, 1), Sample(0.3 * b, 0.35 * b, 1), Sample(0.6 * b, 0.65 * b, 1)], b, "WARNING"),
            ("the age over the budget but falling (recovering)",
             [Sample(0, 1.9 * b, 40), Sample(0.5 * b, 1.5 * b, 30), Sample(b, 1.2 * b, 20)], b, "ERROR"),
            ("the age under the budget and falling fast",
             [Sample(0, 0.9 * b, 400), Sample(0.5 * b, 0.5 * b, 800), Sample(b, 0.2 * b, 2000)], b, "OK"),
            ("the age creeping up slowly (a fifth as fast as the clock)",
             [Sample(0, 0.2 * b, 50), Sample(0.5 * b, 0.3 * b, 60), Sample(b, 0.4 * b, 70)], b, "OK"),
            ("the age climbing at 0.8 s per second, depth small",
             [Sample(0, 0.1 * b, 3), Sample(0.25 * b, 0.3 * b, 3), Sample(0.5 * b, 0.5 * b, 2)], b, "WARNING"),
            ("a single sample, under the budget", [Sample(0, 0.7 * b, 5000)], b, "OK"),
            ("a single sample, exactly at the budget", [Sample(0, b, 1)], b, "ERROR"),
        ]  # fmt: skip
    return cases


# --- the grader's side of the run --------------------------------------------------------------


@dataclass
class Sampled:
    """One call of the monitor's `sample`."""

    a: float  # the grader's clock, before and after the call
    b: float
    phase: str
    reply: Reply
    age: float | None = None
    status: str = ""
    window: list[Sample] = field(default_factory=list)
    failed: str = ""  # "queue_age" or "queue_status" when it raised, "hung", "gone"
    lb: float = 0.0  # the least and the most the true age could have been during the call
    ub: float = 0.0
    depth: int = 0


@dataclass
class Placed:
    """One order placed through the intake."""

    order_id: str
    intake: str  # "A" or "B"
    phase: str
    a: float
    b: float = math.inf
    outcome: str = ""  # accepted, busy, failed, other, hung, gone
    detail: dict[str, Any] = field(default_factory=dict)
    stream_refusing: bool = False
    confirmation_lost: str = ""  # "reply" or "request" for the order whose publish got no confirmation
    lb: float = 0.0
    ub: float = 0.0

    def answer(self) -> str:
        if self.outcome == "failed":
            where = f" at {self.detail['where']}" if self.detail.get("where") else ""
            return f"raised {self.detail.get('error')}({self.detail.get('message', '')}){where}"
        if self.outcome == "other":
            return f"returned {self.detail.get('value')} (neither ACCEPTED nor BUSY)"
        if self.outcome == "hung":
            return f"did not answer within {CALL_DEADLINE:.0f} s (the grader stopped the process)"
        if self.outcome == "gone":
            return "got no answer: the intake process died"
        return f"answered {self.outcome}"


class Truth:
    """When each order was stored and acked: the least and most the queue's age could be in a time span."""

    def __init__(self, handled: Iterable[Handled]) -> None:
        self.orders = sorted(handled, key=lambda h: h.seq)

    def bounds(self, a: float, b: float) -> tuple[float, float, Handled | None]:
        """(lb, ub, the oldest order that could have been waiting) for a reading taken between a and b."""
        could = next((h for h in self.orders if h.ts <= b and h.ack_done > a), None)
        surely = next((h for h in self.orders if h.ts <= a and h.ack_sent > b), None)
        ub = max(0.0, b - could.ts) if could else 0.0
        lb = max(0.0, a - surely.ts) if surely else 0.0
        return lb, ub, could

    def cleared(self, t: float) -> float:
        """When every order stored by `t` was finished (acked): what an order placed at `t` waited behind."""
        return max((h.ack_done for h in self.orders if h.ts <= t and h.ack_done > t), default=t)

    def first_copy(self) -> dict[str, Handled]:
        """Each order id's first stored copy."""
        first: dict[str, Handled] = {}
        for h in self.orders:
            if h.order_id:
                first.setdefault(h.order_id, h)
        return first

    def newest(self, t: float) -> float | None:
        """When the newest order stored by `t` was stored (acked or not), None when none was."""
        return max((h.ts for h in self.orders if h.ts <= t), default=None)

    def age_at(self, t: float) -> float:
        lb, ub, _ = self.bounds(t, t)
        return (lb + ub) / 2


class Lab:
    """Everything one grading run keeps: plan, processes, workers, and what was seen."""

    def __init__(self, run: Run, plan: Plan, pool: Fulfilment, monitor: Child, intakes: list[Child]) -> None:
        self.run = run
        self.plan = plan
        self.pool = pool
        self.monitor = monitor
        self.intakes = intakes
        self.samples: list[Sampled] = []
        self.placed: list[Placed] = []
        self.answers: dict[str, tuple[str, float, dict[str, Any]]] = {}  # order id -> (outcome, ts, detail)
        self.phase = Phases(run)  # labels every sample and order with the phase it was taken in
        self.customers_on = False
        self.order_gap = ORDER_GAP
        self.rush_end = math.inf  # when the rush's slow worker was replaced: waits after it are the grader's doing
        self.next_order = 0
        self.imported: list[str] = []
        self.refusal: tuple[float, float] | None = None
        self.status_replies: list[tuple[str, list[Sample], float, str, Reply]] = []
        self.sampling = True
        self.running = True  # the background loops stop when this turns False (see _stop)
        self.cancels_at: list[float] = []
        self.cancels_sent: list[float] = []  # when each cancellation's publish began (cancels_at: confirmed)
        # Which intake takes the orders: A in the calm step (until its planned kill), B after it, so A's k-th
        # acceptance is an order placed on an empty queue, and B meets the rush with nothing measured before it: a
        # forecast whose drain rate followed the calm step's orders, not the workers' pace, accepted too many
        # (also_right/datetime_and_slope broke its promise on seeds 2 and 4 when B had taken phase 1's orders).
        self.route = "A"
        self.own_publish = asyncio.Lock()  # held by the grader's own publishes, and while a confirmation is lost
        self.lost: list[Lost] = []
        self.locks = {child.pid: asyncio.Lock() for child in intakes}
        self.overdue: set[str] = set()  # accepted orders still not in the stream PHASE_CAP after a silence was due

    def unstored(self) -> list[str]:
        """Orders the intake in use answered ACCEPTED that the stream does not hold (yet: an outbox publishes later).

        Not the ones accepted while the stream refused every publish (a publish without JetStream lost them for
        good; an outbox publishes them before any later one), nor an order a silence already met."""
        held = {h.order_id for h in self.pool.seen.values()} | {lost.order_id for lost in self.lost}
        return [
            p.order_id
            for p in self.placed
            if p.outcome == ACCEPTED and p.intake == self.route and not p.stream_refusing and p.order_id not in held
        ]

    # -- names

    @property
    def stream(self) -> str:
        return self.run.names.stream(STREAM)

    @property
    def durable(self) -> str:
        return self.run.names.durable(DURABLE)

    async def reference(self) -> tuple[float, int] | None:
        """The queue's (age, depth) now, for deciding when a phase is over; None if the server was slow to say."""
        try:
            depth, age = await depth_and_age(self.run.js, self.stream, self.durable, self.run.names.subject(SUBJECT))
        except (TimeoutError, OSError, NatsError):
            return None
        return age, depth

    # -- effects the intake calls

    def attach(self) -> None:
        # Each answer names the order placed (Run.workload): intake A's planned kill lands only on an answer about
        # an order the grader placed, never on one about an order nobody placed.
        self.run.workload.only(*OUTCOMES)
        self.run.workload.first_only(*OUTCOMES)  # an order is answered once: a second answer takes no kill
        for outcome in OUTCOMES:
            self.run.on(outcome, self._answered(outcome))

    def _answered(self, outcome: str) -> Any:
        async def handler(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
            self.run.record_effect(child, outcome, key, **detail)
            if not self.run.workload.decoy(outcome, key):  # a decoy answers no customer (effects_on_the_workload)
                self.answers[key or ""] = (outcome, time.time(), detail)

        return handler

    # -- the monitor

    async def sample(self) -> Sampled | None:
        if not self.monitor.alive:
            return None
        a = time.time()
        reply = await self.monitor.call("sample", CALL_DEADLINE)
        s = Sampled(a, time.time(), self.phase.current, reply)
        value = reply.value if reply.ok and isinstance(reply.value, dict) else {}
        if reply.hung or reply.gone:
            s.failed = "hung" if reply.hung else "gone"
        elif not reply.ok:
            s.failed = "sample"
        elif value.get("failed"):
            s.failed = str(value["failed"])
        s.age = _number(value.get("age"))
        s.status = str(value.get("status", ""))[:40]
        with contextlib.suppress(TypeError, ValueError):
            s.window = [Sample(float(t), float(x), int(d)) for t, x, d in value.get("window", [])]
        s.depth = s.window[-1].depth if s.window else 0
        self.samples.append(s)
        return s

    async def sampler(self) -> None:
        while self.sampling and self.monitor.alive:
            await self.sample()
            await asyncio.sleep(SAMPLE_GAP)

    async def samples_after(self, since: float, n: int) -> None:
        await self.run.wait_for(
            lambda: sum(s.a >= since for s in self.samples) >= n or not self.monitor.alive, PHASE_CAP
        )

    # -- the intake

    def intake(self) -> tuple[str, Child] | None:
        child = self.intakes["AB".index(self.route)]
        return (self.route, child) if child.alive else None

    async def place(self, prefix: str = "o") -> Placed | None:
        chosen = self.intake()
        if chosen is None:
            return None
        label, child = chosen
        self.next_order += 1
        oid = f"{prefix}-{self.next_order:04d}"
        self.run.workload.add(oid)  # before the call: the intake answers about it before the call returns
        order = {"id": oid, "sku": f"sku-{100 + self.next_order % 37}", "qty": 1 + self.next_order % 3}
        async with self.locks[child.pid]:  # one call at a time per process
            p = Placed(oid, label, self.phase.current, time.time())
            self.placed.append(p)
            reply = await child.call("place_order", CALL_DEADLINE, order=order)
        p.b = time.time()
        known = self.answers.get(oid)
        if known is not None:  # the answer reached the grader, even if the process was killed right after
            p.outcome, answered, p.detail = known[0], known[1], dict(known[2])
            p.b = min(p.b, answered)
        elif reply.hung:
            p.outcome = "hung"
        else:
            p.outcome = "gone"
        return p

    async def customers(self) -> None:
        while self.running:
            if self.customers_on and self.intake() is not None:
                # An order every order_gap, counted from when the last was placed, not after its answer: on a busy
                # machine the intake answers slower, and a gap added to each answer let the customers fall to the
                # slow worker's pace (the rush's orders came 1.3-1.8 times as fast as it finished them, not 2-5).
                placed = time.monotonic()
                await self.place()
                await asyncio.sleep(max(0.0, self.order_gap - (time.monotonic() - placed)))
            else:
                await asyncio.sleep(0.01)

    def answered_since(self, since: float) -> list[Placed]:
        return [p for p in self.placed if p.a >= since and p.outcome]

    # -- the shop's other producers (the grader's own connection)

    async def cancellations(self) -> None:
        n = 0
        while self.running:
            n += 1
            body = json.dumps({"id": f"c-{n:04d}", "reason": "customer"}).encode()
            with contextlib.suppress(Exception):
                async with self.own_publish:
                    sent = time.time()
                    await self.run.js.publish(self.run.names.subject(CANCELLED), body)
                self.cancels_at.append(time.time())
                self.cancels_sent.append(sent)
            await asyncio.sleep(CANCEL_EVERY)

    async def import_orders(self, count: int) -> float:
        """Publish `count` orders at once (a marketplace import); returns when the stream holds them all."""
        started = time.time()
        base = len(self.imported)
        subject = self.run.names.subject(SUBJECT)
        for i in range(count):
            oid = f"m-{base + i + 1:04d}"
            self.imported.append(oid)
            await self.run.nc.publish(subject, json.dumps({"id": oid, "sku": "sku-import", "qty": 1}).encode())
        with contextlib.suppress(TimeoutError, NatsError):
            await self.run.nc.flush()

        async def stored() -> bool:
            try:
                info = await self.run.js.consumer_info(self.stream, self.durable)
            except (TimeoutError, OSError, NatsError):
                return False
            return int(info.num_pending or 0) + int(info.num_ack_pending or 0) >= count

        await self.run.wait_for(stored, PHASE_CAP, interval=0.005)
        return started

    async def drained(self) -> bool:
        try:
            info = await self.run.js.consumer_info(self.stream, self.durable)
        except (TimeoutError, OSError, NatsError):
            return False
        return not info.num_pending and not info.num_ack_pending and self.pool.idle

    def quiet_for(self, seconds: float) -> bool:
        """A cancellation published after the last ack was stored at least `seconds` ago: so was the first message
        after the durable's ack floor, and an age read from it (not from the durable's own subject) is that old."""
        acks = [h.ack_done for h in self.pool.seen.values() if math.isfinite(h.ack_done)]
        last = max(acks, default=self.run.t0)
        now = time.time()
        return any(s >= last and c <= now - seconds for s, c in zip(self.cancels_sent, self.cancels_at, strict=False))

    async def age_at_least(self, seconds: float) -> bool:
        now = await self.reference()
        return now is not None and now[0] >= seconds


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    plan = Plan.draw(run.seed)
    await TOPOLOGY.provision(run.js, run.names)
    pool = await Fulfilment(run.js, run.names.stream(STREAM), run.names.durable(DURABLE)).start(2, 0.0)
    monitor, intake_a, intake_b = await asyncio.gather(
        run.spawn("monitor", params=PARAMS),
        run.spawn("intake", faults=[plan.crash()], params=PARAMS),
        run.spawn("intake", params=PARAMS),
    )
    lab = Lab(run, plan, pool, monitor, [intake_a, intake_b])
    lab.attach()
    background = [asyncio.ensure_future(t) for t in (lab.cancellations(), lab.customers())]
    try:
        await _play(lab)
    except (OSError, NatsError) as exc:  # nats.errors.TimeoutError is a TimeoutError, an OSError
        from msglab.errors import GraderError

        raise GraderError(f"the run's nats-server did not answer the grader in time ({exc!r}): try again") from exc
    finally:
        lab.sampling = lab.running = False
        await _stop(background)
        await pool.close()
    handled = await _read_stream(run, pool)
    return [*judge(lab, Truth(h for h in handled.values() if h.ts > 0)), _workload_check(run)]


async def _play(lab: Lab) -> None:
    run, pool, plan, phase = lab.run, lab.pool, lab.plan, lab.phase
    sampler = asyncio.ensure_future(lab.sampler())
    try:
        async with phase("quiet"):  # nothing waits, cancellations arrive
            await run.wait_for(lambda: bool(lab.cancels_at) and time.time() - lab.cancels_at[0] >= QUIET, PHASE_CAP)
            await lab.samples_after(time.time(), 2)

        for _ in range(3):
            async with phase("deep"):  # stall, import a burst, sample while deep, then drain
                await run.wait_for(lab.drained, PHASE_CAP)
                await pool.stall()
                started = await lab.import_orders(plan.burst)
                await lab.samples_after(time.time(), 2)
                young = [s for s in lab.samples if s.a >= started and s.b - started <= BUDGET - CLEAR and not s.failed]
                pool.scale(8, 0.0)
                await run.wait_for(lab.drained, PHASE_CAP)
            if young or not lab.monitor.alive:
                break  # under heavy load a sample can come too late to count as "young": import again

        async with phase("calm"):  # intake A takes orders, each on an empty queue, until its planned kill fired
            await _calm(lab)

        async with phase("over capacity"):  # the rush: one slow worker, customers several times as fast
            pool.scale(1, WORK_SLOW)
            lab.order_gap = RUSH_GAP
            lab.customers_on = True

            # Until the intake has pushed back for a while: by then an intake that refuses only once the age is
            # over the budget has accepted orders that wait about k times the budget (k: arrivals / drain rate).
            def refused_enough() -> bool:
                busy = sum(p.phase == "over capacity" and p.outcome == BUSY for p in lab.placed)
                return lab.intake() is None or busy >= RUSH_REFUSALS

            await run.wait_for(refused_enough, PHASE_CAP)
            lab.customers_on = False
            lab.order_gap = ORDER_GAP
            await run.wait_for(lambda: not any(p.a and not p.outcome for p in lab.placed), CALL_DEADLINE + 1)
            # The slow worker keeps its pace until each order accepted in the rush is finished, or has surely
            # waited longer than the promise allows: only then do the grader's own changes decide a wait.
            await run.wait_for(lambda: _rush_settled(lab), PHASE_CAP)
            lab.rush_end = time.time()

        async with phase("stall"):  # nobody works; the age climbs well over the budget while orders keep coming
            await pool.stall()
            lab.customers_on = True

            async def well_over() -> bool:
                return lab.intake() is None or await lab.age_at_least(BUDGET + 0.3)

            await run.wait_for(well_over, PHASE_CAP)
            since = time.time()
            await run.wait_for(lambda: len(lab.answered_since(since)) >= 3 or lab.intake() is None, PHASE_CAP)

        async with phase("scaled up"):  # the backlog drains; orders keep coming until the age is back under
            pool.scale(6, 0.0)
            await run.wait_for(lab.drained, PHASE_CAP)
            since = time.time()
            await run.wait_for(lambda: len(lab.answered_since(since)) >= 4 or lab.intake() is None, PHASE_CAP)
            lab.customers_on = False
            await run.wait_for(lambda: not any(p.a and not p.outcome for p in lab.placed), CALL_DEADLINE + 1)

        # Not before the rush: a forecast that measured the drain rate here (hundreds a second) in the last second
        # would carry it into the rush's first orders, when one slow worker finishes a dozen a second.
        async with phase("keeping up"):  # a few orders always in hand, none waiting long: every order fits
            await _keeping_up(lab)

        async with phase("stream full"), refuse_publishes(run.js, lab.stream):
            began = time.time()
            for _ in range(plan.refused):
                placed = await lab.place()
                if placed is not None:
                    placed.stream_refusing = True
            lab.refusal = (began, time.time())

        async with phase("stream open"):
            for _ in range(2):
                await lab.place()

        async with phase("confirmation lost"):  # one order stored unconfirmed, one refused unanswered
            for kind in plan.lost:
                if lab.intake() is not None:
                    await _lose_confirmation(lab, kind)

        async with phase("stuck"):  # a trickle of orders flows, one is held by a hung worker
            pool.scale(2, 0.005)
            pool.stuck.add("x-stuck")
            stuck_body = json.dumps({"id": "x-stuck", "sku": "sku-odd", "qty": 1}).encode()
            await _publish(run, SUBJECT, stuck_body)
            flowing = asyncio.Event()
            flowing.set()
            trickle = asyncio.ensure_future(_trickle(lab, flowing))
            try:

                async def stuck_long() -> bool:
                    return await lab.age_at_least(BUDGET + 0.3)

                await run.wait_for(stuck_long, PHASE_CAP)
                since = time.time()  # from here on the stuck order has waited well over the budget

                def shallow_samples() -> bool:
                    seen = [x for x in lab.samples if x.a >= since and not x.failed and x.depth <= SHALLOW]
                    return len(seen) >= 2 or not lab.monitor.alive

                await run.wait_for(shallow_samples, PHASE_CAP)
            finally:
                flowing.clear()
                await _stop([trickle])
            pool.release()

        async with phase("drained"):  # everything drains
            pool.scale(8, 0.0)
            await run.wait_for(lab.drained, PHASE_CAP)
            await lab.samples_after(time.time(), 2)
    finally:
        lab.sampling = False
        await asyncio.gather(sampler, return_exceptions=True)
    await _status_cases(lab)


async def _calm(lab: Lab) -> None:
    """Intake A's planned kill, made to fire by the workload: orders are placed through A one at a time, each on a
    drained queue (eight fast workers), until A was killed right after its k-th ACCEPTED, or k + CALM_SPARE orders.

    It starts once the queue has been empty for QUIET: an intake that reads the age from a message the durable
    never delivers (a cancellation) reads it over the budget on every run, and refuses here every time. A is never
    handed another order (rule 1 says what it answered instead), so no later phase's pace can move its kill.
    """
    run = lab.run
    await run.wait_for(lab.drained, PHASE_CAP)
    await run.wait_for(lambda: lab.quiet_for(QUIET), PHASE_CAP)
    a = lab.intakes[0]
    lab.route = "A"
    try:
        for _ in range(lab.plan.kill_at + CALM_SPARE):
            if not a.alive:
                break
            await run.wait_for(lab.drained, PHASE_CAP)
            await lab.place()
    finally:
        lab.route = "B"


async def _keeping_up(lab: Lab) -> None:
    """The grader's own orders keep a few in the workers' hands, none waiting long; customers come now and then."""
    run, pool = lab.run, lab.pool
    pool.scale(8, KEEP_WORK)
    flowing = asyncio.Event()
    flowing.set()
    start = len(pool.seen)
    feed = asyncio.ensure_future(_feed(lab, flowing))
    try:
        await run.wait_for(lambda: len(pool.seen) - start >= 10, PHASE_CAP)  # the workers have orders in hand
        for _ in range(KEEP_ORDERS):
            if lab.intake() is None:
                break
            placed = time.monotonic()
            await lab.place()
            await asyncio.sleep(max(0.0, KEEP_ORDER_GAP - (time.monotonic() - placed)))
    finally:
        flowing.clear()
        await _stop([feed])
    pool.scale(8, 0.0)
    await run.wait_for(lab.drained, PHASE_CAP)


async def _feed(lab: Lab, flowing: asyncio.Event) -> None:
    """The shop's other orders (the grader's, ids k-...), one every KEEP_GAP, published without waiting."""
    subject, n = lab.run.names.subject(SUBJECT), 0
    while flowing.is_set():
        n += 1
        with contextlib.suppress(TimeoutError, NatsError):
            await lab.run.nc.publish(subject, json.dumps({"id": f"k-{n:04d}", "sku": "sku-shop", "qty": 1}).encode())
        await asyncio.sleep(KEEP_GAP)


@dataclass
class Lost:
    """One order whose publish the stream answered with silence."""

    kind: str  # "reply" (stored, no confirmation sent) or "request" (refused, no refusal sent)
    planned: Planned
    order_id: str  # the order of the first publish the silence met; "" while none did
    attempts: list[float] = field(default_factory=list)  # when the grader saw each publish of it on the subject
    lifted: float = math.inf  # when the grader asked the stream to answer again (nothing later is in the silence)


LOST_WORDS = {
    "reply": "store one order but never send its confirmation (the stream's no_ack, for a moment)",
    "request": "refuse one order (the stream full) without sending the refusal (no_ack, for a moment)",
}


async def _lose_confirmation(lab: Lab, kind: str) -> None:
    """Silence the stream, place orders until a publish meets the silence, and answer again once it was seen.

    The fault lands on the first publish of an order the grader placed that reaches the silent stream: chosen
    when it happens, so an intake that refuses for a while first (a cool-down, a forecast), or publishes later
    what it accepted earlier (an outbox), meets it all the same, at any pace of the machine. The silence begins only
    once no publish of an earlier order can still be under way (the stream holds every order accepted so far), so
    the publish it meets is one of an order placed in it. The orders refused meanwhile are judged like any other; an
    intake that publishes nothing for PHASE_CAP seconds leaves the fault unfired (rule 1 says so).
    """
    from nats.js.api import StreamConfig

    run = lab.run
    planned = Planned(
        f"{LOST_WORDS[kind]} on the first order you published in that moment",
        hint="publish every order you accept to the stream (the grader watches the subject for it)",
    )
    run.planned.append(planned)
    lost = Lost(kind, planned, "")
    lab.lost.append(lost)
    placing: dict[str, asyncio.Future[Placed | None]] = {}  # every order placed in the silence

    async def stored() -> bool:
        try:
            last = await run.js.get_last_msg(lab.stream, run.names.subject(SUBJECT))
        except (TimeoutError, OSError, NatsError):
            return False
        return order_id(last.data) == lost.order_id

    def settled() -> bool:
        """The intake published the order again. Without a retry the silence lasts its full time, whatever was
        answered: lifted on an answer, it could come before the stream had refused the publish it saw, and the stream
        then stored it (core_publish: rule 1 or stored_once failed by the server's timing, seed 42)."""
        return len(lost.attempts) >= 2

    def answered_or_seen(oid: str) -> Callable[[], bool]:
        return lambda: placing[oid].done() or bool(lost.order_id)

    # No publish of an order accepted earlier may still be under way when the silence begins: an outbox's background
    # task that publishes it around that moment met the silence or not by the machine's pace (outbox_in_memory:
    # stored_once flipped, seed 1, 1 of 8 pairs beside a busy loop). The grader waits until the stream holds every
    # order the intake answered ACCEPTED; one that is still not there after PHASE_CAP is not coming soon, and the
    # silence is not started at all (rule 1 says why), rather than left to meet it or not.
    waiting = lab.unstored()
    if waiting and not lab.overdue & set(waiting):
        await run.wait_for(lambda: not lab.unstored() or lab.intake() is None, PHASE_CAP)
    late = lab.unstored()
    if late:
        lab.overdue.update(late)
        shown = ", ".join(late[:3]) + ("…" if len(late) > 3 else "")
        planned.seen = (
            f"{plural(len(late), 'order')} answered ACCEPTED ({shown}) {'were' if len(late) > 1 else 'was'} still not "
            f"in the stream {PHASE_CAP:.0f} s later, so the grader did not silence the stream: a publish could still "
            "be under way, and whether it met the silence would be the machine's doing"
        )
        return
    silent = False  # a publish counts once the stream is silent, never one seen while it was being told to be

    async def seen(msg: Any) -> None:
        oid = order_id(msg.data) or ""
        if silent and lost.order_id in ("", oid) and any(p.order_id == oid for p in lab.placed):  # placed by us
            lost.order_id = oid
            lost.attempts.append(time.time())

    sub = await run.nc.subscribe(run.names.subject(SUBJECT), cb=seen)
    await run.nc.flush()
    async with lab.own_publish:  # the grader's own publishes would get no confirmation either: they wait
        info = await run.js.stream_info(lab.stream)
        original = info.config
        quiet = dict(original.as_dict(), no_ack=True)
        if kind == "request":  # at its current size, discard-new: the next publish does not fit
            quiet.update(max_msgs=max(1, info.state.messages), max_bytes=max(1, info.state.bytes), discard="new")
        await run.js.update_stream(StreamConfig.from_response(quiet))
        silent = True
        try:
            end = time.monotonic() + PHASE_CAP
            while not lost.order_id and time.monotonic() < end and lab.intake() is not None:
                oid = f"o-{lab.next_order + 1:04d}"  # the id lab.place() gives it (the customers are off)
                placing[oid] = asyncio.ensure_future(lab.place())
                await run.wait_for(answered_or_seen(oid), CALL_DEADLINE + 1)
                placed = placing[oid].result() if placing[oid].done() else None
                if not lost.order_id and placed is not None and placed.outcome == ACCEPTED:
                    # Answered before its publish (an outbox): that publish comes next, and meets the silence. Another
                    # order placed meanwhile would be left in the outbox by the machine's pace, not by the plan.
                    await run.wait_for(lambda: bool(lost.order_id), max(0.0, end - time.monotonic()))
                if not lost.order_id:
                    await asyncio.sleep(ORDER_GAP)  # the next customer comes
            if lost.order_id:  # until the order is stored (its confirmation was never sent), or was settled
                await run.wait_for(stored if kind == "reply" else settled, CALL_DEADLINE + 1)
        finally:
            # Stamped before the stream opens: a retry it stores at once is after the silence, however late
            # this process runs again.
            lost.lifted = time.time()
            await run.js.update_stream(original)
    if placing:
        await asyncio.wait(placing.values(), timeout=CALL_DEADLINE + 2)
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    for placed in lab.placed:
        if lost.order_id and placed.order_id == lost.order_id:
            placed.confirmation_lost = kind
    if lost.order_id:
        planned.what = f"{LOST_WORDS[kind]} while order {lost.order_id} was published"
    else:
        replies = [t.result() for t in placing.values() if t.done() and not t.exception()]
        last = next((p for p in reversed(replies) if p is not None), None)
        planned.seen = (
            f"no order reached the stream in the {PHASE_CAP:.0f} s it lasted, while {plural(len(placing), 'order')} "
            "were placed" + (f" (the last, {last.order_id}, {last.answer()})" if last is not None else "")
        )


def _allowed_wait(acks: list[float]) -> float:
    """How long the promise lets an order of the rush wait, from the times its slow worker acked (sorted).

    Load must not change the verdict (rule 8): a machine that starves the slow worker after an order was
    accepted stretches every wait by the same factor, which no forecast made at acceptance could know.
    The budget counts as the time the promise allows at the pace the worker really kept.
    """
    pace = (acks[-1] - acks[0]) / (len(acks) - 1) if len(acks) > 2 else WORK_SLOW
    return BUDGET * max(1.0, pace / WORK_SLOW) + PROMISE_TOL


def _rush_settled(lab: Lab) -> bool:
    """Every order accepted in the rush is acked, or was answered clearly longer ago than the promise allows.

    Clearly (SETTLE_MARGIN past the wait allowed at the worker's pace so far): cut at the bare budget, an order
    a busy machine's slow pace allowed longer was judged on when the grader stopped waiting (kept, or broken,
    by a few ms), not on what the worker did.
    """
    rush = [p for p in lab.placed if p.phase == "over capacity" and p.outcome == ACCEPTED]
    if not rush:
        return True
    start = min(p.a for p in rush)
    acks = sorted(h.ack_sent for h in lab.pool.seen.values() if start <= h.ack_sent < math.inf)
    acked = {h.order_id for h in lab.pool.seen.values() if math.isfinite(h.ack_sent)}
    now, allowed = time.time(), _allowed_wait(acks)
    return all(p.order_id in acked or now - p.b > allowed + SETTLE_MARGIN for p in rush)


async def _stop(tasks: list[asyncio.Task[Any]], patience: float = CALL_DEADLINE + 2) -> None:
    """Wait for loops told to stop (by a flag) to finish; cancel what is still running after `patience`.

    Not cancel() first: nats-py 2.16 can swallow a cancellation that lands inside a publish (its
    _flush_pending catches CancelledError), and a loop that never sees it runs on for ever.
    """
    _, late = await asyncio.wait(tasks, timeout=patience)
    for task in late:
        task.cancel()
    if late:
        await asyncio.wait(late, timeout=1.0)


async def _trickle(lab: Lab, flowing: asyncio.Event) -> None:
    n = 0
    while flowing.is_set():
        n += 1
        body = json.dumps({"id": f"f-{n:04d}", "sku": "sku-trickle", "qty": 1}).encode()
        with contextlib.suppress(TimeoutError, NatsError):
            await lab.run.js.publish(lab.run.names.subject(SUBJECT), body)
        await asyncio.sleep(0.1)


async def _publish(run: Run, subject: str, body: bytes) -> None:
    """The grader's own publish: a slow server gets three tries before the run is the course's failure."""
    for attempt in range(3):
        try:
            await run.js.publish(run.names.subject(subject), body)
            return
        except TimeoutError:
            if attempt == 2:
                raise


async def _read_stream(run: Run, pool: Fulfilment) -> dict[int, Handled]:
    """Every order message the stream holds, with its stored time; acks as the workers recorded them."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    handled = dict(pool.seen)
    config = ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=10.0,
        filter_subject=run.names.subject(SUBJECT),
    )  # fmt: skip
    sub = await run.js.pull_subscribe(run.names.subject(SUBJECT), stream=run.names.stream(STREAM), config=config)
    try:
        info = await sub.consumer_info()
        left = int(info.num_pending or 0)
        deadline = time.monotonic() + PHASE_CAP
        while left > 0 and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(min(left, 500), timeout=1.0)
            except TimeoutError:
                break
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq not in handled:
                    handled[seq] = Handled(seq, msg.metadata.timestamp.timestamp(), order_id(msg.data))
            left -= len(msgs)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return handled


# --- judging -------------------------------------------------------------------------------------


def judge(lab: Lab, truth: Truth) -> list[Check]:
    for s in lab.samples:
        s.lb, s.ub, _ = truth.bounds(s.a, s.b)
    for p in lab.placed:
        p.lb, p.ub, _ = truth.bounds(p.a, p.b if math.isfinite(p.b) else p.a)
    _lost_fired(lab, truth)
    return [
        _age_check(lab, truth),
        _fooled_check(lab, truth),
        _status_check(lab),
        _refuses_over_check(lab, truth),
        _refuses_only_over_check(lab, truth),
        _promise_check(lab, truth),
        _busy_not_error_check(lab),
        _lost_check(lab, truth),
        _stored_once_check(lab, truth),
    ]


def _workload_check(run: Run) -> Check:
    """The platform's effects_on_the_workload (Run.workload_check), with a hint in the intake's terms."""
    check = run.workload_check("answer")
    if not check.passed:
        check.hint = (
            "return ACCEPTED or BUSY from place_order for the order it was handed: the course reports that answer "
            "to the customer; an answer about an order nobody placed reaches nobody"
        )
    return check


def _lost_fired(lab: Lab, truth: Truth) -> None:
    """Rule 1 for the lost confirmations, from the stream's record: did the silence meet a publish of the order?"""
    for lost in lab.lost:
        if not lost.order_id:  # no publish met the silence: _lose_confirmation said what was placed instead
            lost.planned.fired = False
            continue
        before = [h for h in truth.orders if h.order_id == lost.order_id and h.ts < lost.lifted]
        placed = next((p for p in lab.placed if p.order_id == lost.order_id), None)
        answer = placed.answer() if placed is not None else "was never placed (no intake process was left)"
        if lost.kind == "reply":
            lost.planned.fired = bool(before)
        else:
            lost.planned.fired = bool(lost.attempts) and lost.attempts[0] < lost.lifted and not before
        if not lost.planned.fired:
            published = "without publishing it" if not lost.attempts else "and its publish reached the stream"
            lost.planned.seen = f"place_order {answer} for {lost.order_id} {published}"


def _at(lab: Lab, ts: float) -> str:
    return lab.run.at(ts)


def _phase_words(phase: str) -> str:
    return {
        "quiet": "while nothing waited (only cancellations, which the durable does not read, were arriving)",
        "deep": "right after an import of hundreds of orders landed at once (a deep queue, its oldest order young)",
        "calm": "on an empty queue, while the workers kept up",
        "keeping up": "while the workers kept up with the shop's orders (a few in hand, none waiting long)",
        "over capacity": "while one slow worker fell behind the customers",
        "stall": "while every worker was stalled",
        "scaled up": "after six workers had drained the backlog",
        "stream full": "while the stream refused every publish",
        "stream open": "after the stream accepted publishes again",
        "confirmation lost": "while the stream sent no confirmation for one publish",
        "stuck": "while a worker hung on one order and the rest flowed (a shallow queue, its oldest order old)",
        "drained": "after everything had drained",
    }.get(phase, phase)


def _monitor_broken(lab: Lab, title: str, name: str, kinds: tuple[str, ...] = ()) -> Check | None:
    """A failing check when the monitor never gave a usable sample, or failed (in one of `kinds`), with the cause."""
    failed = next((s for s in lab.samples if s.failed and (not kinds or s.failed in kinds)), None)
    usable = [s for s in lab.samples if not s.failed]
    if failed is None and usable:
        return None
    if failed is None:
        return Check(name, title, False, "the grader got no sample from your monitor at all.",
                     hint="queue_age must return a number of seconds")  # fmt: skip
    value = failed.reply.value if isinstance(failed.reply.value, dict) else {}
    if failed.failed in ("hung", "gone"):
        message = (
            f"your monitor's sample at {_at(lab, failed.a)} ({_phase_words(failed.phase)}) {failed.reply.describe()}."
        )
        hint = "queue_age and queue_status must answer at once: ask the broker, never wait for the queue to change"
    else:
        what = value.get("failed", "queue_age")
        where = f" at {value['where']}" if value.get("where") else ""
        raised = (
            f"raised {value.get('error')}({value.get('message', '')}){where}"
            if value.get("error")
            else value.get("message", "failed")
        )
        message = f"{what} {raised} at {_at(lab, failed.a)}, {_phase_words(failed.phase)}."
        hint = "the queue can be empty, deep, or stuck: your monitor must answer in every case"
        if value.get("error") == "NotFoundError":
            hint = "when no order waits there is no message to read: that is an age of 0.0, not an error"
        elif what == "queue_age" and "not a number" in str(value.get("message")):
            hint = "return the age as a number of seconds (a float), 0.0 when nothing waits"
    return Check(name, title, False, message, hint=hint)


def _age_check(lab: Lab, truth: Truth) -> Check:
    name = "age_tracks_truth"
    title = "queue_age reports how long the oldest unfinished order has waited"
    broken = _monitor_broken(lab, title, name, ("queue_age", "hung", "gone", "sample"))
    if broken is not None:
        return broken
    judged = [s for s in lab.samples if s.age is not None]
    wrong = [s for s in judged if not (s.lb - AGE_TOLERANCE <= s.age <= s.ub + AGE_TOLERANCE)]  # type: ignore[operator]
    if not wrong:
        return Check(name, title, True)
    # The most telling sample: a quiet, deep or stuck moment if there is one.
    order = ["stuck", "quiet", "drained", "deep", "stall"]

    def off(s: Sampled) -> float:
        return max(s.lb - (s.age or 0.0), (s.age or 0.0) - s.ub)

    first = min(wrong, key=lambda s: (order.index(s.phase) if s.phase in order else 9, -off(s)))
    _, _, oldest = truth.bounds(first.a, first.b)
    shown = f"{first.age:.3f} s" if first.age is not None else "nothing"
    truly = f"between {first.lb:.3f} and {first.ub:.3f} s" if first.ub - first.lb > 0.0005 else f"{first.ub:.3f} s"
    message = (
        f"{len(wrong)} of {len(judged)} samples were off by more than {AGE_TOLERANCE * 1000:.0f} ms. "
        f"At {_at(lab, first.a)}, {_phase_words(first.phase)}, queue_age said {shown}; the oldest unfinished "
        f"order had waited {truly}"
        + (
            f" ({oldest.order_id}, stored at {_at(lab, oldest.ts)}, depth {first.depth})."
            if oldest
            else f" (nothing waited, depth {first.depth})."
        )
    )
    trace = [
        f"{_at(lab, s.a)} {s.phase}: queue_age {s.age:.3f} s, truly {s.lb:.3f}-{s.ub:.3f} s, depth {s.depth}"
        for s in wrong[:5]
        if s.age is not None
    ]
    hint = _age_hint(lab, wrong, first, truth)
    return Check(name, title, False, message, trace=trace, hint=hint)


def _age_hint(lab: Lab, wrong: list[Sampled], first: Sampled, truth: Truth) -> str:
    phases = {s.phase for s in wrong}
    ages = [s.age for s in lab.samples if s.age is not None]
    if ages and all(a == 0 for a in ages):
        return "queue_age always said 0: measure it, from the oldest order the durable has not seen acked"
    # Which wrong number was read: the newest order's age, or the depth turned into seconds?
    busy = [s for s in wrong if s.age is not None and s.depth > 0]

    def like_newest(s: Sampled) -> bool:
        at_a, at_b = truth.newest(s.a), truth.newest(s.b)
        if at_a is None or at_b is None or s.age is None:
            return False
        return max(0.0, s.a - at_b) - AGE_TOLERANCE / 2 <= s.age <= s.b - at_a + AGE_TOLERANCE / 2

    if len(busy) >= 3 and sum(map(like_newest, busy)) >= 0.8 * len(busy):
        return (
            "your age is the newest order's (the last one stored): while orders keep coming the newest is always "
            "young, and a stalled or stuck queue looks fresh. The queue's age is its oldest unfinished order's: "
            "the first one after the durable's ack floor"
        )
    # The age a fixed time per order, at every depth seen (the depth is read just after the age: medians per depth).
    by_depth: dict[int, list[float]] = {}
    for x in busy:
        if x.age:
            by_depth.setdefault(x.depth, []).append(x.age / x.depth)
    medians = sorted(sorted(r)[len(r) // 2] for r in by_depth.values())
    per_order = medians[len(medians) // 2] if medians else 0.0
    spread = len(by_depth) >= 3 and max(by_depth) >= 3 * min(by_depth)
    close = sum(abs(m - per_order) <= 0.25 * per_order for m in medians)
    if spread and per_order > 0 and close >= 0.8 * len(medians):
        return (
            f"your age moves with the depth (about {per_order * 1000:.0f} ms per order): a count is "
            "not a time. Hundreds of orders that landed a moment ago have waited a moment, and one stuck order can "
            "wait for ever: read the oldest unfinished order's stored time"
        )
    late = [s for s in wrong if s.phase in ("stuck", "drained") and s.age is not None and s.age > s.ub + 1.0]
    starts = lab.cancels_at[:1] + [h.ts for h in truth.orders[:1]]
    stream_first = min(starts, default=lab.run.t0)  # about when the stream stored its first message

    def like_first(s: Sampled) -> bool:
        return s.age is not None and abs(s.age - (s.a - stream_first)) <= 0.1 + (s.b - s.a)

    if late and sum(map(like_first, late)) < 0.8 * len(late) and phases & {"quiet", "drained"}:
        late = []  # growing, but not from the stream's first message: the cancellation after the floor (below)
    if late:
        return (
            "your age kept growing for the whole run: the stream keeps acked orders (limits retention), so "
            "its first message is not the oldest unfinished one; start from the durable's ack floor"
        )
    if "quiet" in phases or "drained" in phases:
        return (
            "when every order was done your age still grew: the message after the ack floor may be an "
            "orders.cancelled event, which the durable never delivers; look only at the durable's own subject"
        )
    if "stuck" in phases and first.age is not None and first.age < first.lb:
        return (
            "an order a worker holds without acking is still unfinished: start from the durable's ack floor, "
            "not from what it has delivered"
        )
    if "deep" in phases:
        return "depth is not age: hundreds of orders that landed a moment ago have waited a moment"
    return "the age is now minus the stored time of the first un-acked order after the durable's ack floor"


def _fooled_check(lab: Lab, truth: Truth) -> Check:
    name = "not_fooled_by_depth"
    title = "the monitor is fooled neither by a deep but fast queue nor by a shallow but stuck one"
    broken = _monitor_broken(lab, title, name)
    if broken is not None:
        return broken
    usable = [s for s in lab.samples if not s.failed and s.window]
    deep = [s for s in usable if s.depth >= DEEP and s.ub <= BUDGET - CLEAR]
    stuck = [s for s in usable if s.depth <= SHALLOW and s.lb >= BUDGET + CLEAR and s.phase == "stuck"]
    deep_wrong = [s for s in deep if s.status == "ERROR"]
    stuck_wrong = [s for s in stuck if s.status != "ERROR"]
    if not deep or not stuck:
        missing = "a deep queue with a young head" if not deep else "a shallow queue with an old head"
        slow = max((s.b - s.a for s in usable), default=0.0)
        return Check(name, title, False,
                     f"could not be tested: the grader got no sample of {missing} (your monitor's samples took up to "
                     f"{slow:.2f} s each).", hint="queue_age and queue_status must answer in milliseconds")  # fmt: skip
    if not deep_wrong and not stuck_wrong:
        return Check(name, title, True)
    lines = []
    if deep_wrong:
        s = deep_wrong[0]
        lines.append(
            f"Deep but fast: at {_at(lab, s.a)} the queue held {s.depth} orders and the oldest had waited at most "
            f"{s.ub:.3f} s (the workers drained it moments later); your monitor said ERROR (queue_age {s.age:.3f} s)."
        )
    if stuck_wrong:
        s = stuck_wrong[0]
        which = "it" if s.depth == 1 else "one of them"
        lines.append(
            f"Shallow but stuck: at {_at(lab, s.a)} the queue held {plural(s.depth, 'order')}; a hung worker had held "
            f"{which} for at least {s.lb:.3f} s (budget {BUDGET:.1f} s); your monitor said {s.status or 'nothing'} "
            f"(queue_age {s.age:.3f} s)."
        )
    # Whose fault: the age (it agreed with the status it got) or the status (it ignored the age it got)?
    age_too_high = [s for s in deep_wrong if s.age is not None and s.age >= BUDGET]
    age_too_low = [s for s in stuck_wrong if s.age is not None and s.age < BUDGET]
    status_on_depth = [s for s in deep_wrong if s.age is not None and s.age < BUDGET]
    if age_too_low and status_on_depth:
        hint = (
            f"two faults: queue_age said {age_too_low[0].age:.3f} s for an order held unacked for "
            f"{age_too_low[0].lb:.3f} s (measure from the durable's ack floor), and queue_status said ERROR for an "
            "age under the budget (judge by the age, never the depth)"
        )
    elif age_too_low:
        s = age_too_low[0]
        hint = (
            f"queue_age said {s.age:.3f} s for an order a worker had held unacked for {s.lb:.3f} s: it is unfinished, "
            "so count it, from the durable's ack floor (the status follows the age)"
        )
    elif age_too_high:
        s = age_too_high[0]
        hint = (
            f"queue_age said {s.age:.3f} s for a queue whose oldest order had waited at most {s.ub:.3f} s: fix it "
            "first (age_tracks_truth), the status follows it"
        )
    elif deep_wrong and stuck_wrong:
        hint = "depth said 'alarm' for a queue that drained in a moment and 'fine' for a stuck one: use the age"
    elif deep_wrong:
        hint = "queue_status said ERROR for an age under the budget: the depth plays no part, however deep the queue"
    else:
        hint = "queue_status must say ERROR when the newest age is at or over the budget, however shallow the queue"
    trace = [f"{_at(lab, w.t)}: age {w.age:.3f} s, depth {w.depth}" for w in (deep_wrong or stuck_wrong)[0].window[-4:]]
    return Check(name, title, False, "\n".join(lines), trace=trace, hint=hint)


def _status_check(lab: Lab) -> Check:
    name = "status_from_level_and_trend"
    title = "queue_status gives OK, WARNING or ERROR from the age's level and trend (the README's rule)"
    for what, samples, budget, expected, reply in lab.status_replies:
        got = reply.value if reply.ok else None
        if got == expected:
            continue
        shown = f"returned {got!r}" if reply.ok else reply.describe()
        window = ", ".join(f"(t {s.t:g}, age {s.age:g}, depth {s.depth})" for s in samples)
        message = (
            f"for {what} (budget {budget:g} s) queue_status {shown}; the rule says {expected}.\nThe window: {window}."
        )
        return Check(name, title, False, message, hint=_status_hint(expected, got, samples, budget))
    for s in lab.samples:
        if s.failed or not s.window or _borderline(s.window, BUDGET):
            continue
        expected = expected_status(s.window, BUDGET)
        if s.status != expected:
            window = ", ".join(f"(+{w.t - lab.run.t0:.2f}s, {w.age:.3f} s, {w.depth})" for w in s.window[-5:])
            message = (
                f"at {_at(lab, s.a)}, {_phase_words(s.phase)}, queue_status said {s.status!r} for your own samples; "
                f"the rule says {expected}.\nThe window's last samples (time, age, depth): {window}."
            )
            return Check(name, title, False, message, hint=_status_hint(expected, s.status, s.window, BUDGET))
    if not lab.status_replies:
        return Check(name, title, False, "could not be tested: the monitor process was gone.",
                     hint="fix the other monitor checks first")  # fmt: skip
    return Check(name, title, True)


def _status_hint(expected: str, got: Any, samples: list[Sample], budget: float) -> str:
    if got not in STATUSES:
        return "return one of the strings 'OK', 'WARNING', 'ERROR'"
    newest = samples[-1]
    if expected == "ERROR":
        return "ERROR whenever the newest age is at or over the budget, whatever the depth or the trend"
    if got == "ERROR" and newest.age < budget:
        return "under the budget the status is never ERROR, however deep the queue is"
    if expected == "WARNING":
        return (
            "WARNING when the age grew, from the window's first sample to its newest, by at least half the time "
            "between them"
        )
    return "OK when the age is under the budget and not climbing at half the clock's pace; depth plays no part"


def _judged(p: Placed) -> bool:
    return p.outcome in (ACCEPTED, BUSY) and not p.stream_refusing and not p.confirmation_lost


def _refuses_over_check(lab: Lab, truth: Truth) -> Check:
    name = "refuses_over_budget"
    title = "place_order refuses (BUSY) while the queue's age is over the budget"
    over = [p for p in lab.placed if _judged(p) and p.lb >= BUDGET + INTAKE_CLEAR]
    accepted = [p for p in over if p.outcome == ACCEPTED]
    # An intake that refuses an empty queue refuses over the budget too, proving nothing: not judged as passing,
    # whether or not one of its other answers happened to meet a young queue. Judged on the calm step, where every
    # order meets an empty queue that has been empty a while on every run (a lucky acceptance elsewhere came and
    # went with the machine's pace).
    calm = [p for p in lab.placed if p.phase == "calm" and p.outcome in (ACCEPTED, BUSY)]
    if calm:
        refused_all = not any(p.outcome == ACCEPTED for p in calm)
    else:
        answered = [p for p in lab.placed if p.phase != "stream full"]
        refused_all = bool(lab.placed) and not any(p.outcome == ACCEPTED for p in answered)
    if over and not accepted and not refused_all:
        return Check(name, title, True)
    if not accepted:
        stalled = [p for p in lab.placed if p.phase == "stall"]
        hung = next((p for p in stalled if p.outcome == "hung"), None)
        odd = next((p for p in stalled if p.outcome not in (ACCEPTED, BUSY)), None)
        if hung is not None:
            message = (
                f"{hung.order_id}, placed while every worker was stalled and the age was climbing past the budget, "
                f"{hung.answer()}. A customer kept waiting is not refused: the answer must come at once."
            )
            hint = "answer at once: refuse with BUSY rather than wait for the queue to drain"
        elif refused_all:
            if calm:
                message = (
                    f"could not be tested: place_order refused every order placed while nothing waited and the "
                    f"workers kept up ({len(calm)} of them, each on an empty queue), so its refusals say nothing "
                    "about the age."
                )
            else:
                message = (
                    f"could not be tested: place_order refused every order ({len(lab.placed)} of them), so its "
                    "refusals say nothing about the age: the queue of the customers' orders never grew old enough "
                    "to judge one."
                )
            hint = "fix refuses_only_over_budget first: accept while the age is under the budget"
        else:
            message = (
                f"could not be tested: none of the {len(stalled)} orders placed while the workers were stalled got an "
                f"answer while the age was clearly over the budget ({BUDGET:.1f} s)"
                + (f"; {odd.order_id} {odd.answer()}" if odd else "")
                + "."
            )
            hint = "answer every order at once, with ACCEPTED or BUSY"
        return Check(name, title, False, message, hint=hint)
    p = accepted[0]
    _, _, oldest = truth.bounds(p.a, p.b)
    message = (
        f"{len(accepted)} of {len(over)} orders placed while the age was clearly over the budget ({BUDGET:.1f} s) "
        f"were accepted. {p.order_id} was accepted at {_at(lab, p.a)}, {_phase_words(p.phase)}: the oldest order "
        f"had waited at least {p.lb:.3f} s"
        + (f" ({oldest.order_id})" if oldest else "")
        + ". A customer told 'accepted' now waits longer than the shop promises."
    )  # fmt: skip
    trace = [f"{_at(lab, q.a)} {q.order_id}: {q.outcome}, age at least {q.lb:.3f} s" for q in accepted[:5]]
    hint = "before accepting, measure the queue's age and answer BUSY when it is over env.age_budget"
    if not any(q.outcome == BUSY for q in lab.placed):
        hint = "place_order never refused anything: nothing pushes back on a queue unless the producer does"
    return Check(name, title, False, message, trace=trace, hint=hint)


def _refuses_only_over_check(lab: Lab, truth: Truth) -> Check:
    name = "refuses_only_over_budget"
    title = "place_order refuses only an order the shop could not finish in time, and accepts again once it can"
    # Judged by what happened: the queue was young (its oldest order had waited at most YOUNG) and short (the orders
    # ahead were all finished within SPARE), so accepted, the order would have been finished in time. Young, because
    # refusing on the age with a margin is the learner's choice. Not judged while every worker was stalled for the
    # import (nobody can know when they come back) or while the stream refused publishes.
    judged = [p for p in lab.placed if _judged(p) and p.phase != "deep"]
    needless = [p for p in judged if p.outcome == BUSY and p.ub <= YOUNG and truth.cleared(p.a) - p.a <= SPARE]
    if len(needless) < NEEDLESS_MIN:
        if not any(p.outcome == ACCEPTED for p in judged):
            return Check(name, title, False, f"could not be tested: place_order accepted none of the {len(judged)} "
                         "orders placed while the workers ran.", hint="accept while the queue is short")  # fmt: skip
        return Check(name, title, True)
    p = needless[0]
    ahead = truth.cleared(p.a) - p.a
    message = (
        f"{len(needless)} of {len(judged)} orders were refused though the shop could have kept its promise to them: "
        f"the oldest unfinished order had waited at most {YOUNG:.2f} s and every order ahead was finished within "
        f"{SPARE:.2f} s (budget {BUDGET:.1f} s). {p.order_id} got BUSY at {_at(lab, p.a)}, {_phase_words(p.phase)}: "
        f"the oldest unfinished order had waited at most {p.ub:.3f} s, and the orders ahead of it were all finished "
        f"{ahead:.3f} s later."
    )
    phases = {q.phase for q in needless}
    if phases & {"scaled up", "stream open", "drained"}:
        message += " The backlog had been cleared by then: refusals must stop as soon as the shop can keep its promise."
        hint = "measure for every order; a refusal that outlives the backlog turns customers away for nothing"
    elif p.ub < 0.001:
        hint = "an empty queue always has room: refuse only when the order would wait too long"
    else:
        hint = (
            "refuse when the order would wait longer than env.age_budget: by its forecast (depth / drain rate), or "
            "by the age against a threshold set from how much faster orders arrive than they are finished; not sooner"
        )
    high = [s for s in lab.samples if s.age is not None and s.age > s.ub + AGE_TOLERANCE and s.a <= p.b]
    off = max(high, key=lambda s: (s.age or 0.0) - s.ub, default=None)
    if off is not None:
        hint = (
            f"if place_order measures the age with your queue_age, fix that first: at {_at(lab, off.a)} it said "
            f"{off.age:.3f} s when the oldest order had waited at most {off.ub:.3f} s"
        )
    trace = [
        f"{_at(lab, q.a)} {q.order_id} ({q.phase}): busy, ahead cleared {truth.cleared(q.a) - q.a:.3f} s later"
        for q in needless[:5]
    ]
    return Check(name, title, False, message, trace=trace, hint=hint)


def _promise_check(lab: Lab, truth: Truth) -> Check:
    name = "promise_kept"
    title = "every order accepted during the rush is finished within the budget (the promise itself)"
    first = truth.first_copy()
    rush = [p for p in lab.placed if p.phase == "over capacity" and p.outcome == ACCEPTED and p.order_id in first]
    if not rush:
        return Check(name, title, False, "could not be tested: no order accepted during the rush (one slow worker, "
                     "customers several times as fast) reached the stream.",
                     hint="fix refuses_only_over_budget and no_accepted_order_lost first")  # fmt: skip

    def waited(p: Placed) -> float:  # at least this long (the slow worker was replaced at rush_end)
        h = first[p.order_id]
        return min(h.ack_sent, lab.rush_end) - h.ts

    start = min(p.a for p in rush)
    acks = sorted(o.ack_sent for o in truth.orders if start <= o.ack_sent <= lab.rush_end)
    allowed = _allowed_wait(acks)  # the budget at the pace the worker really kept (rule 8)
    pace = (acks[-1] - acks[0]) / (len(acks) - 1) if len(acks) > 2 else WORK_SLOW
    slowdown = max(1.0, pace / WORK_SLOW)
    late = [p for p in rush if waited(p) > allowed]
    if not late:
        return Check(name, title, True)
    p = max(late, key=waited)
    h = first[p.order_id]
    ahead = sum(1 for o in truth.orders if o.ts <= h.ts and o.ack_done > p.a and o is not h)
    rush_acks = sorted(o.ack_sent for o in truth.orders if p.a <= o.ack_sent <= min(lab.rush_end, p.a + 1.0))
    rate = (len(rush_acks) - 1) / (rush_acks[-1] - rush_acks[0]) if len(rush_acks) > 2 else 0.0
    finished = f"finished {waited(p):.3f} s" if h.ack_sent <= lab.rush_end else f"still unfinished {waited(p):.3f} s"
    message = (
        f"{len(late)} of {len(rush)} orders accepted during the rush waited longer than the budget ({BUDGET:.1f} s, "
        f"tolerance {PROMISE_TOL:.2f} s"
        + (f"; the worker kept {pace * 1000:.0f} ms an order, so {allowed:.2f} s in all" if slowdown > 1 else "")
        + f"). {p.order_id}, accepted at {_at(lab, p.a)} while the oldest unfinished order "
        f"had waited {p.lb:.3f}-{p.ub:.3f} s, was {finished} after the stream stored it: {plural(ahead, 'order')} "
        f"were ahead of it" + (f", finished at about {rate:.0f} a second." if rate else ".")
    )
    if p.ub < BUDGET:
        hint = (
            "the age was under the budget when you accepted it, but the age is how long the oldest order has "
            "waited, not how long a new one will: behind a queue that grows, a new order waits depth / drain rate "
            "(Little's law), about k times the age. Refuse on that forecast, or on the age with a margin (budget / k)"
        )
    else:
        hint = "refuse an order the shop cannot finish within env.age_budget: forecast its wait as depth / drain rate"
    trace = [f"{_at(lab, q.a)} {q.order_id}: accepted, waited {waited(q):.3f} s" for q in late[:5]]
    return Check(name, title, False, message, trace=trace, hint=hint)


def _busy_not_error_check(lab: Lab) -> Check:
    name = "busy_when_stream_full"
    title = "place_order answers ACCEPTED or BUSY, and BUSY while the stream is full (never an exception)"
    during = [p for p in lab.placed if p.stream_refusing]
    bad_during = [p for p in during if p.outcome != BUSY]
    errors = [p for p in lab.placed if p.outcome in ("failed", "other") and not p.stream_refusing]
    if not bad_during and not errors and during:
        return Check(name, title, True)
    if not during:
        stopped = next((p for p in lab.placed if p.outcome == "hung"), None)
        why = f" ({stopped.order_id} {stopped.answer()})" if stopped else ""
        return Check(name, title, False, f"could not be tested: no intake process was left when the stream refused "
                     f"publishes{why}.", hint="place_order must answer every order at once")  # fmt: skip
    if bad_during:
        p = bad_during[0]
        message = (
            f"while the stream refused every publish (full, discard-new: error 10077), {p.order_id} {p.answer()}."
            " The customer must hear 'busy, try later', and nothing the stream did not store may be reported accepted."
        )
        if p.outcome == ACCEPTED:
            hint = "report ACCEPTED only once the stream has confirmed it stored the order; a refused publish is BUSY"
        elif p.outcome == "failed":
            hint = "the stream's refusal is an error the publish raises: catch it and answer BUSY"
        else:
            hint = "answer BUSY when the stream refuses the order"
        return Check(name, title, False, message, hint=hint)
    p = errors[0]
    message = f"{p.order_id}, placed {_phase_words(p.phase)}, {p.answer()}."
    hint = "place_order answers every order with ACCEPTED or BUSY; handle what can fail inside it"
    if p.detail.get("error") == "NotFoundError":
        hint = "when no order waits there is no message to read: that is an age of 0.0, not an error"
    return Check(name, title, False, message, hint=hint)


def _lost_check(lab: Lab, truth: Truth) -> Check:
    name = "no_accepted_order_lost"
    title = "every accepted order is in the stream and processed, also when the intake is killed right after"
    by_id: dict[str, list[Handled]] = {}
    for h in truth.orders:
        if h.order_id:
            by_id.setdefault(h.order_id, []).append(h)
    accepted = [p for p in lab.placed if p.outcome == ACCEPTED]
    lost = [p for p in accepted if not by_id.get(p.order_id)]
    unprocessed = [
        p for p in accepted if by_id.get(p.order_id) and not any(math.isfinite(h.ack_done) for h in by_id[p.order_id])
    ]
    if not lost and not unprocessed:
        return Check(name, title, True)
    crashes = lab.run.log.events("crash", ACCEPTED)
    killed = crashes[0].key if crashes else None
    first = next((p for p in lost if p.order_id == killed), lost[0] if lost else unprocessed[0])
    if first in lost:
        shown = ", ".join(p.order_id for p in lost[:8])
        message = f"{len(lost)} of {len(accepted)} accepted orders never reached the stream: {shown}"
        message += "…" if len(lost) > 8 else "."
        if first.order_id == killed:
            message += (
                f"\n{first.order_id} was answered 'accepted' by intake {first.intake}, which the grader SIGKILLed "
                "right after that answer: the order was still only in the process's memory, and died with it."
            )
            hint = "answer ACCEPTED only after the stream confirmed it stored the order; memory dies with the process"
        elif first.stream_refusing:
            message += f"\n{first.order_id} was answered 'accepted' while the stream refused every publish."
            hint = "report ACCEPTED only once the stream has confirmed it stored the order"
        else:
            message += (
                f"\nThe stream holds no order {first.order_id} on {SUBJECT}, the subject the fulfilment durable reads."
            )
            hint = (
                "publish each accepted order as JSON (with its \"id\") to env.subject('orders.placed'), and wait "
                "for the stream's confirmation"
            )
        return Check(name, title, False, message, hint=hint)  # fmt: skip
    message = (
        f"{len(unprocessed)} accepted orders were in the stream but never processed by the end: "
        f"{', '.join(p.order_id for p in unprocessed[:8])}."
    )
    return Check(name, title, False, message, hint="publish orders to env.subject('orders.placed') as JSON")


def _stored_once_check(lab: Lab, truth: Truth) -> Check:
    name = "stored_once"
    title = "a publish without a confirmation is settled by asking again: each order stored once, answered as stored"
    copies: dict[str, int] = {}
    for h in truth.orders:
        if h.order_id and h.order_id.startswith("o-"):  # the customers' orders (the grader's own have other ids)
            copies[h.order_id] = copies.get(h.order_id, 0) + 1
    for lost in lab.lost:
        p = next((q for q in lab.placed if q.order_id == lost.order_id), None)
        if p is None or not lost.planned.fired:
            continue  # rule 1 says so
        n = copies.get(lost.order_id, 0)
        how = (
            "the stream stored it and sent no confirmation"
            if lost.kind == "reply"
            else "the stream, full, refused it and sent no refusal"
        )
        retry = (
            "publish the same order again, marked as the same (the Nats-Msg-Id header: the order's id), until the "
            "stream answers; it stores a retry once and confirms it (as a duplicate when it had the order)"
        )
        if p.outcome == "hung":
            message = (
                f"{p.order_id} {p.answer()}: {how}, and the publish waited for an answer that never came "
                "(nats-py's JetStream publish waits 5 s unless told otherwise)."
            )
            hint = (
                "give the publish a timeout of your own, well under a second, and treat a timeout as unknown: " + retry
            )
        elif p.outcome in ("failed", "other", "gone"):
            message = f"{p.order_id}: {how}; place_order {p.answer()}."
            hint = "a publish that times out is an unknown outcome, not an error to pass on: " + retry
        elif n > 1:
            message = (
                f"the stream holds {n} copies of {p.order_id}: {how}, and the retry stored it again, so the workers "
                "fulfil it twice."
            )
            hint = "a retry must be recognisable as the same order: the same Nats-Msg-Id (its id) on every publish"
        elif p.outcome == BUSY and n:
            message = (
                f"{p.order_id} was answered BUSY, but the stream holds it ({how}): the customer hears 'try later' and "
                "the order ships anyway."
            )
            hint = "a timeout is not a refusal: " + retry
        elif p.outcome == ACCEPTED and not n:
            message = f"{p.order_id} was answered ACCEPTED, but the stream never stored it: {how}."
            hint = "a timeout is not a confirmation either: " + retry
        else:
            continue
        return Check(name, title, False, message, hint=hint)
    twice = sorted(oid for oid, n in copies.items() if n > 1)
    if twice:
        message = (
            f"the stream holds {plural(len(twice), 'order')} more than once ({', '.join(twice[:5])}): the workers "
            "fulfil each copy."
        )
        return Check(name, title, False, message, hint="publish each order once, or mark every publish of it with "
                     "the same Nats-Msg-Id (its id) so the stream stores it once")  # fmt: skip
    if not any(lost.planned.fired for lost in lab.lost):
        return Check(name, title, False, "could not be tested: no publish met a lost confirmation.",
                     hint="publish every order you accept")  # fmt: skip
    return Check(name, title, True)


# --- the synthetic windows run before the live phases end ---------------------------------------


async def _status_cases(lab: Lab) -> None:
    for what, samples, budget, expected in status_cases(lab.plan):
        if not lab.monitor.alive:
            return
        reply = await lab.monitor.call("status", CALL_DEADLINE, samples=[list(s) for s in samples], budget=budget)
        lab.status_replies.append((what, samples, budget, expected, reply))
