"""Lab 02 grader: an invoice worker that must never lose an invoice, crashed where it hurts most.

Workload (seeded): INVOICES invoice requests wait on a durable. The learner's worker runs in
one process after another ("incarnations"). Each of the first three is SIGKILLed at one crash
point, in an order and on a call drawn from the seed (calls 1-3 of that point, so every crash
falls on a message):
  before_work   inside env.send_invoice, before the invoice goes out;
  after_work    inside env.send_invoice, after the invoice went out (so before the ack);
  after_ack     inside env.settled, which the task says to call once the ack is confirmed.
TRANSIENT of the requests make env.send_invoice raise env.TransientError on their first try.
A last incarnation (restarted if it dies) runs until everything is acked.

Invariants judged on the effect store and consumer_info:
  every request is invoiced (none lost); an invoice goes out twice only when an after_work crash
  fell on it; every message is acked; every invoice is reported settled; and the learner's
  GUARANTEES names the right guarantee for each worker in workers.py.

Why after_ack exposes a bare msg.ack(): the ack only sits in the client's write buffer until the
event loop runs the flusher, and env.settled is synchronous, so the SIGKILL comes first and the
server redelivers. ack_sync() returns only once the server has the ack: no redelivery.
(Measured over seeds 1-40 on a busy 2-core machine: the solution passed 40 of 40, the same
worker with a bare msg.ack() failed 40 of 40, each time on this duplicate alone.)
Incarnations are started ahead of time and released with a line on stdin, so a restart costs
milliseconds, not a Python start-up.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from msglab.grading.harness import Child, Run
from msglab.grading.labkit import LabEnv, provision
from msglab.grading.nemesis import Crash, rng
from msglab.grading.verdict import Check

STREAM = "BILLING"
SUBJECT = "billing.invoice"
DURABLE = "invoicer"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more. Shorter would be faster, but a busy machine must
# never stall a correct worker past it (that redelivery would look like a missing ack).
INVOICES = 12
TRANSIENT = 2  # requests whose first env.send_invoice raises env.TransientError
KINDS = {  # crash kind -> (counted point, moment), as nemesis plans name them
    "before_work": ("send_invoice", "before"),  # the n-th call of env.send_invoice
    "after_work": ("invoice_sent", "after"),  # the n-th invoice that went out (a failed call is no invoice)
    "after_ack": ("settled", "after"),  # the n-th call of env.settled
}
WHERE = {
    "before_work": "before the invoice went out",
    "after_work": "after the invoice went out, before the worker acked",
    "after_ack": "in env.settled, after the worker's ack call had returned",
}
MAX_WORKERS = 8  # incarnations in all; a worker that keeps dying is not restarted forever
CRASH_DEADLINE = 3.0  # a crash incarnation that has not crashed by then is killed
SETTLE = 5.0  # how long the last incarnation has to finish everything
REPORT_GRACE = 1.0  # once all is acked, how long env.settled may still take to be called
PARAMS: dict[str, Any] = {}  # env carries nothing else; the transient keys are added per run

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"
# The workers of labs/02_delivery_guarantees/workers.py and the guarantee each gives the invoice.
ANSWERS = {
    "core_subscriber": AT_MOST_ONCE,  # core NATS keeps nothing for a subscriber that is down
    "ack_then_work": AT_MOST_ONCE,  # the ack is on the server before the work: a crash in between loses it
    "work_then_ack": AT_LEAST_ONCE,  # a crash after the work, before the ack, brings it back: done twice
    "ack_in_finally": NEITHER,  # a failed call is acked anyway (lost); a kill after the charge redoes it
    "dedup_then_ack": EFFECTIVELY_ONCE,  # redelivered, but the processed row makes the second time a no-op
}


class TransientError(Exception):
    """The invoicing service is busy for a moment; the same request will succeed if retried."""


# --- what runs inside the learner's processes ------------------------------------------------


def _add_effects(env: Any) -> None:
    """Give env the lab's effects: send_invoice (a crash point, sometimes transient) and settled."""
    transient = set(env.params.get("transient", []))

    def failed_before(key: str) -> bool:
        row = env.log.db.execute(
            "select 1 from events where kind = 'note' and name = 'transient' and key = ? limit 1", (key,)
        ).fetchone()
        return row is not None

    async def send_invoice(order_id: str) -> None:
        key = str(order_id)
        call = env.nemesis.called("send_invoice")
        env.log.record("note", "attempt", key, call=call)
        # A real call to an invoicing service takes a network round trip; this one does too, and
        # like any round trip it also sends what the worker left in its write buffer (an ack).
        await env.nc.flush()
        env.nemesis.point("send_invoice", call, "before", key)
        if key in transient and not failed_before(key):
            env.log.record("note", "transient", key, call=call)
            raise env.TransientError(f"the invoicing service is busy, invoice {key} was not sent; retry it")
        env.log.record("effect", "send_invoice", key, call=call)
        # Counted apart from calls, so a transient failure cannot make a planned crash miss.
        env.nemesis.point("invoice_sent", env.nemesis.called("invoice_sent"), "after", key)

    def settled(order_id: str) -> None:
        key = str(order_id)
        call = env.nemesis.called("settled")
        env.log.record("effect", "settled", key, call=call)
        env.nemesis.point("settled", call, "after", key)

    env.TransientError = TransientError
    env.send_invoice = send_invoice
    env.settled = settled


async def _wait_for_go() -> None:
    """Block until the grader writes a line on stdin: the process is started ahead of its turn."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()


async def role_invoice_worker(env: LabEnv, learner: Any) -> None:
    """One incarnation of the invoice worker: waits for its turn, then runs until killed."""
    _add_effects(env)
    guarantees = getattr(learner, "GUARANTEES", None)
    if isinstance(guarantees, dict):
        guarantees = {str(k): None if v is None else str(v) for k, v in guarantees.items()}
    env.log.record("note", "guarantees", None, value=guarantees)  # type: ignore[attr-defined]
    await _wait_for_go()
    env.log.record("note", "started", None)  # type: ignore[attr-defined]
    await learner.invoice_worker(env)


async def playground(env: Any) -> None:
    """For the lab notebook: the same stream and durable, and effects that print."""
    await _setup(env.js, env.names)
    env.TransientError = TransientError
    tried: set[str] = set()

    async def send_invoice(order_id: str) -> None:
        if order_id not in tried and order_id.endswith("3"):  # one flaky request, to try the retry path
            tried.add(order_id)
            print(f"invoicing service busy for {order_id}: TransientError")
            raise TransientError(f"the invoicing service is busy, invoice {order_id} was not sent; retry it")
        print(f"invoice sent for {order_id}")

    env.send_invoice = send_invoice
    env.settled = lambda order_id: print(f"{order_id} settled")


# --- the grader ------------------------------------------------------------------------------


async def _setup(js: Any, names: Any) -> None:
    # The platform team's part: the stream and the durable exist before any worker starts.
    await provision(js, names, stream=STREAM, wildcard="billing.>", durable=DURABLE, subject=SUBJECT, ack_wait=ACK_WAIT)


@dataclass
class Schedule:
    """The seeded faults of one run: one crash per crash incarnation, and the flaky requests."""

    crashes: list[tuple[str, int]]  # (kind, call number within that incarnation)
    transient: list[str]

    @classmethod
    def draw(cls, seed: int, keys: list[str]) -> Schedule:
        kinds = list(KINDS)
        rng(seed, "crash_order").shuffle(kinds)
        calls = rng(seed, "crash_calls")
        crashes = [(kind, calls.randint(1, 3)) for kind in kinds]
        transient = sorted(rng(seed, "transient").sample(keys, TRANSIENT), key=keys.index)
        return cls(crashes, transient)

    def plan(self, incarnation: int) -> list[Crash]:
        if incarnation >= len(self.crashes):
            return []
        kind, call = self.crashes[incarnation]
        effect, when = KINDS[kind]
        return [Crash(effect, call, when)]


@dataclass
class Workers:
    """The incarnations: started ahead of their turn, released one at a time."""

    run: Run
    schedule: Schedule
    params: dict[str, Any]
    started: list[Child] = field(default_factory=list)  # released, in order
    ended: dict[int, tuple[float, str]] = field(default_factory=dict)  # pid -> (when, how)
    waiting: list[asyncio.Task[Child]] = field(default_factory=list)

    def prepare(self, count: int) -> None:
        for _ in range(count):
            number = len(self.started) + len(self.waiting)
            faults = self.schedule.plan(number)
            self.waiting.append(
                asyncio.ensure_future(self.run.spawn("invoice_worker", faults=faults, params=self.params))
            )

    async def release(self) -> Child:
        if not self.waiting:
            self.prepare(1)
        child = await self.waiting.pop(0)
        assert child.proc.stdin is not None
        child.proc.stdin.write(b"go\n")
        await child.proc.stdin.drain()
        self.started.append(child)
        return child

    def note_end(self, child: Child) -> None:
        if child.pid in self.ended:
            return
        crashed = any(e.pid == child.pid for e in self.run.log.events("crash"))
        if crashed:
            how = "crashed (injected)"
        elif child.died:
            died = child.died
            said = str(died.get("message"))
            said = said if len(said) <= 100 else said[:97] + "..."
            how = f"exited: your code raised {died.get('error')}({said}) at {died.get('where')}"
        elif child.alive:
            how = "was stopped by the grader"
        else:
            how = "exited on its own (invoice_worker returned)"
        self.ended[child.pid] = (time.time(), how)

    async def cancel(self) -> None:
        for task in self.waiting:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, so asyncio does not warn about it
            task.cancel()


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    t0 = time.time()
    keys = [f"o-{i}" for i in range(1, INVOICES + 1)]
    schedule = Schedule.draw(run.seed, keys)
    params = {**PARAMS, "transient": schedule.transient}
    await _setup(run.js, run.names)
    # The requests wait on the durable before any worker runs, as a backlog would.
    publishes = [
        run.js.publish(run.names.subject(SUBJECT), json.dumps({"order_id": k, "amount": 10 + i}).encode())
        for i, k in enumerate(keys)
    ]
    workers = Workers(run, schedule, params)
    workers.prepare(len(schedule.crashes) + 1)
    await asyncio.gather(*publishes)

    async def consumer() -> Any:
        return await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(DURABLE))

    def invoiced() -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in run.log.events("effect", "send_invoice"):
            counts[event.key or ""] = counts.get(event.key or "", 0) + 1
        return counts

    def unexplained() -> dict[str, int]:
        allowed = _allowed_invoices(run)
        return {k: n for k, n in invoiced().items() if n > allowed.get(k, 1)}

    clean_since: list[float] = []

    def reports_due() -> bool:
        """A live worker invoiced a request and has not reported it yet: env.settled is on its way."""
        alive = {c.pid for c in workers.started if c.alive}
        last: dict[str, tuple[str, int]] = {}
        for event in run.log.events("effect"):
            last[event.key or ""] = (event.name, event.pid)
        return any(name == "send_invoice" and pid in alive for name, pid in last.values())

    async def done() -> bool:
        # Everything delivered and acked: nothing more can arrive, whether all was invoiced or not;
        # only the reports of the last acks may still be on their way (ack_sync, then env.settled).
        info = await consumer()
        if info.num_ack_pending == 0 and info.num_pending == 0:
            clean_since[:] = clean_since or [time.monotonic()]
            return not reports_due() or time.monotonic() - clean_since[0] > REPORT_GRACE
        clean_since.clear()
        # A redelivery that no crash explains shows acks are missing; once every request has been
        # invoiced and reported, waiting longer (for a worker that never acks) only adds more.
        sent, reported = invoiced(), {e.key for e in run.log.events("effect", "settled")}
        crashed = {e.key for e in run.log.events("crash")}
        missing_acks = any(k not in crashed for k in unexplained())
        return missing_acks and all(sent.get(k) for k in keys) and reported >= set(sent)

    def ended_or_done(child: Child) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return _ended(child) or await done()

        return check

    try:
        # The crash incarnations: each runs until its crash (or until there is nothing left to do).
        for _ in schedule.crashes:
            child = await workers.release()
            await run.wait_for(ended_or_done(child), CRASH_DEADLINE)
            if child.alive:
                await child.kill()
            workers.note_end(child)
        # The last incarnation runs until everything is acked; if it dies, the next one takes over.
        deadline = time.monotonic() + SETTLE
        while True:
            child = await workers.release()
            finished = await run.wait_for(ended_or_done(child), max(0.0, deadline - time.monotonic()))
            if not child.alive or child.died:
                await child.kill()
                workers.note_end(child)
            if (finished and await done()) or time.monotonic() >= deadline or len(workers.started) >= MAX_WORKERS:
                break
        info = await consumer()
    finally:
        await workers.cancel()
    for child in workers.started:
        workers.note_end(child)

    trace = _traces(run, workers, t0)
    sent = invoiced()
    return [
        _lost_check(run, keys, sent, trace, workers, info),
        _duplicate_check(run, sent, trace),
        _acked_check(info),
        _settled_check(run, keys, sent, trace),
        _guarantees_check(run),
    ]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ended(child: Child) -> bool:
    return not child.alive or child.died is not None


def _allowed_invoices(run: Run) -> dict[str, int]:
    """How often each request may be invoiced: once, plus once per crash between work and ack."""
    allowed: dict[str, int] = {}
    for crash in run.log.events("crash", "invoice_sent"):
        if crash.key:
            allowed[crash.key] = allowed.get(crash.key, 1) + 1
    return allowed


def _crash_kind(effect: str, when: str) -> str:
    return next(kind for kind, spot in KINDS.items() if spot == (effect, when))


def _traces(run: Run, workers: Workers, t0: float) -> dict[str, list[str]]:
    """Per request, what happened to it, one line per event, with the worker pid."""

    def at(ts: float) -> str:
        return f"+{ts - t0:.2f}s"

    trace: dict[str, list[str]] = {}
    for event in run.log.events():
        if not event.key:
            continue
        steps = trace.setdefault(event.key, [])
        who = f"worker {event.pid}"
        if event.kind == "note" and event.name == "attempt":
            steps.append(
                f"{at(event.ts)} delivered to {who}, which calls env.send_invoice (its call #{event.detail['call']})"
            )
        elif event.kind == "note" and event.name == "transient":
            steps.append(f"{at(event.ts)} env.send_invoice raised TransientError in {who}: the invoice did not go out")
        elif event.kind == "effect" and event.name == "send_invoice":
            steps.append(f"{at(event.ts)} invoice sent by {who}")
        elif event.kind == "effect" and event.name == "settled":
            steps.append(f"{at(event.ts)} {who} reported it settled")
        elif event.kind == "crash":
            kind = _crash_kind(event.name, event.detail.get("when", ""))
            steps.append(f"{at(event.ts)} {who} SIGKILLed {WHERE[kind]}")
    return trace


def _lost_check(
    run: Run, keys: list[str], sent: dict[str, int], trace: dict[str, list[str]], workers: Workers, info: Any
) -> Check:
    title = "every invoice request is invoiced, whatever crashed (none lost)"
    lost = [k for k in keys if not sent.get(k)]
    if not lost:
        return Check("no_lost_invoices", title, True)
    transient = {e.key for e in run.log.events("note", "transient")}
    crashed_before = {e.key for e in run.log.events("crash", "send_invoice")}
    attempted = {e.key for e in run.log.events("note", "attempt")}
    # Explain the most telling lost request: a crash before the work, then a transient failure.
    key = next((k for k in lost if k in crashed_before), None) or next((k for k in lost if k in transient), lost[0])
    message = f"{len(lost)} of {len(keys)} invoice requests were never invoiced: {', '.join(lost)}."
    deaths = [how for _, how in workers.ended.values() if "raised" in how]
    if info.num_ack_pending or info.num_pending:
        # Not provably acked: the broker still held messages for redelivery when the run ended.
        message += (
            f"\n{key} did not come back before the run ended ({SETTLE:.0f} s after the last restart); the durable"
            f" still held {info.num_ack_pending} unacked and {info.num_pending} undelivered messages."
        )
        hint = "keep fetching and ack each message with `await msg.ack_sync()` once env.send_invoice returned"
    elif key in crashed_before:
        message += (
            f"\n{key}: the worker was SIGKILLed before its invoice went out, and the broker never delivered it again:"
            " it had already been acked. Acking before the work is at-most-once."
        )
        hint = "ack only after env.send_invoice returned: a crash before the ack then means redelivery, not loss"
    elif key in transient:
        message += (
            f"\n{key}: env.send_invoice raised TransientError, and the message never came back: it was acked although"
            " its invoice did not go out (an ack before the work, in `finally`, or after catching the error)."
            " That is at-most-once for every call that fails."
        )
        hint = "ack only when env.send_invoice succeeded; on env.TransientError call msg.nak() so it is redelivered"
    elif key not in attempted:
        message += f"\n{key} never reached env.send_invoice."
        hint = "bind to env.durable('invoicer') on env.stream('BILLING') with pull_subscribe_bind and keep fetching"
    else:
        message += f"\n{key} was delivered, but its invoice never went out and it was not redelivered."
        hint = "call env.send_invoice for every message and ack only after it returned"
    if deaths:
        message += f"\nYour worker also {deaths[0]}; {_plural(len(deaths), 'time')} in all (the grader restarted it)."
    return Check("no_lost_invoices", title, False, message, trace=[*trace.get(key, []), "never invoiced"], hint=hint)


def _duplicate_check(run: Run, sent: dict[str, int], trace: dict[str, list[str]]) -> Check:
    title = "an invoice goes out twice only when a crash fell between sending it and acking it"
    allowed = _allowed_invoices(run)
    extra = {k: n for k, n in sent.items() if n > allowed.get(k, 1)}
    if not extra:
        return Check("duplicates_only_after_work_crash", title, True)
    after_ack = {e.key for e in run.log.events("crash", "settled")}
    crashed = {e.key for e in run.log.events("crash")}
    # The clearest evidence first: a duplicate with no crash at all means a missing ack.
    key = next((k for k in extra if k not in crashed), None) or next((k for k in extra if k in after_ack), None)
    key = key or next(iter(extra))
    pids = sorted({e.pid for e in run.log.events("effect", "send_invoice") if e.key == key})
    message = (
        f"{_plural(len(extra), 'invoice')} went out more often than the crashes explain: {key} {extra[key]} times "
        f"(by workers {', '.join(map(str, pids))}), allowed {allowed.get(key, 1)}."
    )
    if key in after_ack:
        message += (
            f"\nThe crash on {key} fell in env.settled, after your ack call had returned, yet the broker delivered"
            " it again: the ack never reached the server. msg.ack() only puts it in the client's write buffer;"
            " a process killed before the buffer is flushed takes the ack with it (or env.settled ran before the ack)."
        )
        hint = "use `await msg.ack_sync()`: it returns only once the server has recorded the ack; then call env.settled"
    else:
        message += (
            f"\nNo crash fell between {key}'s invoice and its ack, so the broker redelivered it because no ack came"
            f" within ack_wait ({ACK_WAIT:.1f} s)."
        )
        hint = "ack every message once its invoice went out (msg.ack_sync()), on the durable env.durable('invoicer')"
    return Check("duplicates_only_after_work_crash", title, False, message, trace=trace.get(key, []), hint=hint)


def _acked_check(info: Any) -> Check:
    title = "every invoice request is acked on the durable 'invoicer' (nothing stuck)"
    pending, unacked = info.num_pending, info.num_ack_pending
    if pending == 0 and unacked == 0:
        return Check("all_acked", title, True)
    return Check(
        "all_acked",
        title,
        False,
        f"the durable 'invoicer' still has {pending} undelivered and {unacked} delivered-but-unacked messages "
        f"({info.num_redelivered} redelivered) after the run: without an ack the broker redelivers every "
        f"{ACK_WAIT:.1f} s, forever.",
        hint="ack each message with `await msg.ack_sync()` once env.send_invoice returned",
    )


def _settled_check(run: Run, keys: list[str], sent: dict[str, int], trace: dict[str, list[str]]) -> Check:
    title = "every invoice is reported with env.settled once its ack is confirmed"
    reported = {e.key for e in run.log.events("effect", "settled")}
    missing = [k for k in keys if sent.get(k) and k not in reported]
    if not missing:
        return Check("settled_reported", title, True)
    crashed_after = {e.key for e in run.log.events("crash", "invoice_sent")}
    key = next((k for k in missing if k in crashed_after), missing[0])
    message = (
        f"{_plural(len(missing), 'invoiced request')} never reported settled: {', '.join(missing)}. The billing"
        " dashboard counts settled invoices from env.settled, so it is now behind."
    )
    hint = "call env.settled(order_id) right after `await msg.ack_sync()` returned, for every message"
    if key in crashed_after:
        message += (
            f"\n{key}: the worker was SIGKILLed after its invoice, before env.settled, and the broker never delivered"
            " it again: it had been acked before its work was finished."
        )
        hint = "ack after the invoice went out: a crash before the ack then brings the message back to finish it"
    return Check("settled_reported", title, False, message, trace=trace.get(key, []), hint=hint)


def _guarantees_check(run: Run) -> Check:
    title = "GUARANTEES names the guarantee each worker in workers.py gives"
    rows = run.log.events("note", "guarantees")
    given = rows[0].detail.get("value") if rows else None
    if not isinstance(given, dict):
        return Check(
            "guarantees_named",
            title,
            False,
            f"GUARANTEES in your file is {given!r}, not a dict from worker name to guarantee.",
            hint=f"keep GUARANTEES a dict with the keys {', '.join(ANSWERS)}",
        )
    wrong = [(name, given.get(name)) for name in ANSWERS if given.get(name) != ANSWERS[name]]
    if not wrong:
        return Check("guarantees_named", title, True)
    name, got = wrong[0]
    return Check(
        "guarantees_named",
        title,
        False,
        f"{len(wrong)} of {len(ANSWERS)} workers are classified wrong; first: {name} is {got!r}.",
        hint=f"ask what a crash, or a failed call, at each line of {name} does to the message; the answer is one of "
        f"{AT_MOST_ONCE!r}, {AT_LEAST_ONCE!r}, {EFFECTIVELY_ONCE!r}, {NEITHER!r}",
    )
