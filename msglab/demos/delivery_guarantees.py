"""Lesson 02's experiments: real worker processes, SIGKILLed on a seeded schedule, and the ack timer.

    async def ack_first(env, msg):
        await msg.ack_sync()
        await env.charge(msg.data.decode())

    result = await crashlab.run(ack_first, messages=200, crashes=10, seed=7)
    result.lost, result.duplicated

`run` ships the handler's source to worker processes of its own (`python -m msglab.grading.runner`
through the grading harness, with this module as the "grader"), publishes `messages` orders to a
stream with a durable, and lets one worker after another handle them; each of the first `crashes`
workers is SIGKILLed at one point drawn from the seed: inside `env.charge` before or after the
charge is committed, or inside `env.done` (the step a handler calls right after acking). The same
seed gives the same schedule to every handler, so two orders of ack and work can be compared on
equal terms. Every delivery, charge, ack and crash is a row in the run's effect store (see
msglab.grading.effects); `Result` holds them for counting and for `msglab.notebook.timeline`.

`timer_run` puts two or three workers on one order to show what the ack timer does: a job longer
than ack_wait (with or without `in_progress()` heartbeats), and a worker that stalls past ack_wait
and acks late while the order is in another worker's hands (the zombie).

`run_workers` is the machinery under both, shared with lesson 03 (msglab.demos.idempotency).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import tempfile
import textwrap
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msglab.grading.effects import Event as Row
from msglab.grading.harness import Child, Run
from msglab.grading.nemesis import Crash, rng
from msglab.grading.sandbox import Sandbox
from msglab.grading.scaffold import HeldSpawns, Topology, held

STREAM = "ORDERS"
SUBJECT = "orders.charge"
DURABLE = "payments"
ACK_WAIT = 0.5  # seconds; production uses 30 s, an experiment cannot wait that long
TOPOLOGY = Topology(STREAM, "orders.>", DURABLE, "", ACK_WAIT)  # the durable delivers all the stream holds
POINTS = {  # where a worker can be killed, as nemesis plans name it
    "before": ("charge", "before"),  # inside env.charge, before the charge is committed
    "after": ("charge", "after"),  # inside env.charge, after the charge is committed
    "done": ("done", "after"),  # inside env.done, called right after the ack
}
WORDS = {"before": "before the charge", "after": "after the charge", "done": "right after the ack call returned"}
HEADER = (  # what a lesson cell has imported, for the handler's module
    "from __future__ import annotations\n\nimport asyncio\nimport json\nimport sqlite3\nimport time\nimport uuid\n"
    "from typing import Any\n"
)


# --- what runs inside the worker processes ---------------------------------------------------


def _add_effects(env: Any) -> None:
    """env.charge, env.done and env.fraud_check: effects the notebook's side of the run answers.

    The kill plan stays in the notebook's process: the worker only makes the calls, and the
    run SIGKILLs it when a planned call arrives (before or after recording the charge).
    """

    async def charge(order_id: str) -> None:
        await env.nc.flush()  # a call to a payment service takes a round trip; so does this one
        env.world.call("charge", order_id)

    def done(order_id: str) -> None:
        env.world.call("done", order_id)

    async def fraud_check(order_id: str) -> None:
        env.world.call("fraud_check", order_id)  # the whole process waits for the answer

    env.charge = charge
    env.done = done
    env.fraud_check = fraud_check


def _record_acks(env: Any, msg: Any, key: str) -> None:
    """Wrap msg's ack calls so the timeline knows when each was made (ack) or confirmed (ack_sync)."""
    ack, ack_sync = msg.ack, msg.ack_sync

    async def recorded_ack() -> None:
        await ack()
        env.world.note("ack", key, sync=False)

    async def recorded_ack_sync(timeout: float = 1.0) -> Any:
        reply = await ack_sync(timeout=timeout)
        env.world.note("ack", key, sync=True)
        return reply

    msg.ack, msg.ack_sync = recorded_ack, recorded_ack_sync


async def fetch_loop(env: Any, handler: Callable[..., Awaitable[Any]], key_of: Callable[[Any], str]) -> None:
    """Fetch one message at a time from the run's durable and hand it to the handler, for ever."""
    env.world.note("started", None)
    sub = await env.js.pull_subscribe_bind(env.durable(env.params["consumer"]), env.stream(env.params["stream_name"]))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=1)
        except TimeoutError:
            continue
        for msg in msgs:
            key = key_of(msg)
            env.world.note("delivery", key, n=msg.metadata.num_delivered, seq=msg.metadata.sequence.stream)
            _record_acks(env, msg, key)
            await handler(env, msg)
            env.world.note("handled", key)  # so the run can tell the last message is finished


async def role_worker(env: Any, learner: Any) -> None:
    """One worker process: wait held for its turn (msglab.grading.scaffold), then fetch and hand each message
    to the handler."""
    _add_effects(env)
    held(env)
    await fetch_loop(env, getattr(learner, env.params["handler"]), lambda msg: msg.data.decode())


# --- the handler's module --------------------------------------------------------------------


def _globals_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_used(const)
    return names


def write_handler(handler: Callable[..., Any]) -> tuple[str, str]:
    """Write the handler as a module: the lesson cell's imports, the plain constants it uses, its source.

    A constant is a global of the cell's that is a str, number, bool or bytes (CREDIT = "insert
    ..."); the worker process gets it with the same value. Returns (folder, path).
    """
    folder = tempfile.mkdtemp(prefix="msglab-handler-")
    path = os.path.join(folder, "handler.py")
    constants = []
    for name in sorted(_globals_used(handler.__code__)):
        value = handler.__globals__.get(name)
        if isinstance(value, str | int | float | bool | bytes) and not name.startswith("__"):
            constants.append(f"{name} = {value!r}\n")
    body = HEADER + "\n" + "".join(constants) + "\n\n" + textwrap.dedent(inspect.getsource(handler))
    Path(path).write_text(body)
    return folder, path


# --- running workers -------------------------------------------------------------------------


@dataclass
class Raw:
    """What one run of workers left behind: the effect log's rows and who ran."""

    rows: list[Row]
    pids: list[int]
    published: int
    stored: int
    seconds: float


async def run_workers(
    handler: Callable[..., Any],
    *,
    grader: str,
    stream: str,
    subject: str,
    payloads: Sequence[bytes],
    headers: Sequence[dict[str, str] | None] | None = None,
    plan: Sequence[list[Crash]] = (),
    kill_at: Sequence[tuple[str, str]] = (),
    params: dict[str, Any] | None = None,
    setup: Callable[[Run], Awaitable[dict[str, Any]]] | None = None,
    kernel_user: bool = False,
    seed: int = 0,
    ahead: int = 3,
    timeout: float = 20.0,
) -> Raw:
    """Publish the payloads, then run one worker process after another: worker i meets the faults plan[i].

    A worker with faults runs until it dies (or until nothing is left to do, when the grader ends
    it); the worker after the last planned one runs until every message is acked and it is idle.
    `kill_at` plans kills by message instead: (effect, key) kills whichever worker makes that
    effect call for that key first (`env.world.call(effect, key)`), once; each worker then runs
    until it is killed or everything is done.
    Workers start `ahead` turns early, so a restart after a kill is instant. `setup(run)` runs
    before any worker starts and returns extra params for them (a service's subject, say);
    `kernel_user` runs the workers as the notebook's own user (they write the lesson's files).
    """
    folder, path = write_handler(handler)
    started = time.perf_counter()
    topology = Topology(stream, subject.split(".")[0] + ".>", DURABLE, "", ACK_WAIT, {"max_ack_pending": 1000})
    lab = Run(grader, path, seed)
    if kernel_user:
        lab.sandbox = Sandbox(why_not="a lesson's own experiment, run as the notebook's user")
    try:
        async with lab:
            names = lab.names
            await topology.provision(lab.js, names)
            extra = await setup(lab) if setup is not None else {}
            worker_params = {"handler": handler.__name__, "stream_name": stream, "consumer": DURABLE}
            worker_params |= (params or {}) | extra
            turns = [*plan, []] if not kill_at else [[] for _ in range(len(kill_at) + 1)]
            planned, fired = set(kill_at), set()

            def killer(point: str) -> Callable[[Child, str | None, dict[str, Any], int], Awaitable[None]]:
                async def maybe_kill(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
                    if (point, key) in planned and (point, key) not in fired:
                        fired.add((point, key))
                        lab.log.record("crash", point, key, pid=child.pid, role=child.role, call=call, when="before")
                        await child.kill("nemesis")  # the worker waits for this call's answer: it never comes

                return maybe_kill

            for point in {p for p, _ in planned}:
                lab.on(point, killer(point))

            workers = HeldSpawns(lab, "worker", lambda i: list(turns[i]), len(turns), params=worker_params)
            workers.prepare(min(ahead, len(turns)))
            sent = await asyncio.gather(
                *(
                    lab.js.publish(names.subject(subject), body, headers=(headers[i] if headers else None))
                    for i, body in enumerate(payloads)
                )
            )
            stored = len({ack.seq for ack in sent})
            pids: list[int] = []

            async def acked() -> bool:
                return await topology.drained(lab)

            def idle(pid: int) -> bool:
                """The worker has finished every message it took (an ack may come before the work)."""
                notes = [e.name for e in lab.log.events("note") if e.pid == pid]
                return notes.count("delivery") == notes.count("handled")

            async def finished(pid: int) -> bool:
                return idle(pid) and await acked()

            deadline = time.monotonic() + timeout
            try:
                for i in range(len(turns)):
                    if i + ahead < len(turns):
                        workers.prepare(1)
                    child = await workers.release()
                    assert child is not None  # never more turns than its limit
                    pids.append(child.pid)
                    remaining = max(0.1, deadline - time.monotonic())
                    if turns[i]:
                        # A worker due to crash runs until it does (or until nothing is left to do).
                        await lab.wait_for(lambda c=child: not c.alive or acked(), remaining)  # type: ignore[misc]
                        await child.kill()
                    elif kill_at:
                        # Any worker may meet a planned kill: run it until it dies or everything is done.
                        await lab.wait_for(lambda c=child: not c.alive or finished(c.pid), remaining)  # type: ignore[misc]
                        if child.alive:
                            break
                    else:
                        await lab.wait_for(lambda c=child: finished(c.pid), remaining)  # type: ignore[misc]
            finally:
                await workers.cancel()  # the ones started ahead of a turn that never came
            rows = lab.log.events()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return Raw(rows, pids, len(payloads), stored, time.perf_counter() - started)


# --- the crash experiment --------------------------------------------------------------------


@dataclass
class Event:
    """One thing that happened to one message (or to a worker, key None)."""

    t: float  # seconds since the run started
    kind: str  # delivery, charge, ack, crash, started, fraud_check, handled
    key: str | None
    pid: int
    detail: dict[str, Any] = field(default_factory=dict)


def events_of(rows: Sequence[Row], points: dict[str, tuple[str, str]] | None = None) -> list[Event]:
    """The run's rows as Events, timed from the first; a crash names its point when `points` knows it."""
    t0 = rows[0].ts if rows else 0.0
    events = []
    for row in rows:
        if row.kind == "crash":
            spot = (row.name, row.detail.get("when"))
            point = next((p for p, s in (points or {}).items() if s == spot), row.name)
            events.append(Event(row.ts - t0, "crash", row.key, row.pid, {"point": point}))
        elif row.name != "done":  # an effect (charge) or a note (delivery, ack, started), by its name
            events.append(Event(row.ts - t0, row.name, row.key, row.pid, dict(row.detail)))
    return events


@dataclass
class Result:
    """What one run did: counts for the lesson, events for the timeline."""

    handler: str
    messages: int
    seed: int
    schedule: list[tuple[str, int]]  # (point, call) per crashed worker
    events: list[Event]
    workers: list[int]  # pids, in the order they ran
    seconds: float
    published: int = 0  # publishes made (orders plus the producer's retries)
    stored: int = 0  # messages the stream kept (Nats-Msg-Id drops a retried publish)

    @property
    def charges(self) -> Counter[str]:
        return Counter(e.key for e in self.events if e.kind == "charge" and e.key)

    @property
    def lost_orders(self) -> list[str]:
        """The orders never charged."""
        charged = self.charges
        return [order_key(i) for i in range(1, self.messages + 1) if not charged.get(order_key(i))]

    @property
    def charged_again(self) -> list[str]:
        """The orders charged more than once."""
        return sorted(k for k, n in self.charges.items() if n > 1)

    @property
    def lost(self) -> int:
        """How many orders were never charged."""
        return len(self.lost_orders)

    @property
    def duplicated(self) -> int:
        """Extra charges: every charge of an order beyond its first."""
        return sum(n - 1 for n in self.charges.values())

    @property
    def crashes(self) -> list[Event]:
        return [e for e in self.events if e.kind == "crash"]

    @property
    def reordered(self) -> list[tuple[str, str]]:
        """(order, a later order) pairs where the order's last delivery came after the later one's first.

        Each order appears once, with the latest-published order that overtook it.
        """
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        for e in self.events:
            if e.kind == "delivery" and e.key:
                first.setdefault(e.key, e.t)
                last[e.key] = e.t
        pairs = []
        for key in sorted(last):
            later = [k for k in first if k > key and first[k] < last[key]]
            if later:
                pairs.append((key, max(later)))
        return pairs

    def story(self, key: str) -> list[str]:
        """What happened to one order, one line per event."""
        shown = [e for e in self.events if e.key == key and e.kind != "handled"]
        return [f"+{e.t:.2f}s worker {e.pid}: {_describe(e)}" for e in shown]

    def summary(self) -> str:
        points = Counter(p for p, _ in self.schedule)
        where = ", ".join(f"{n} {WORDS[p]}" for p, n in points.items())
        return (
            f"{self.handler}: {self.messages} orders, {len(self.crashes)} crashes ({where}): "
            f"{self.lost} lost, {self.duplicated} charged again ({self.seconds:.1f} s)"
        )

    def __repr__(self) -> str:
        return self.summary()


def _describe(event: Event) -> str:
    if event.kind == "delivery":
        return f"delivery #{event.detail.get('n')}"
    if event.kind == "ack":
        return "ack_sync returned (the server has it)" if event.detail.get("sync") else "ack() returned (queued)"
    if event.kind == "crash":
        return f"SIGKILL {WORDS.get(event.detail['point'], 'at ' + str(event.detail['point']))}"
    if event.kind == "fraud_check":
        return "fraud check answered"
    return event.kind


def order_key(i: int) -> str:
    """The order id of message number i (1-based)."""
    return f"o-{i:03d}"


def schedule_for(seed: int, crashes: int, messages: int, points: Sequence[str]) -> list[tuple[str, int]]:
    """The seeded crash plan: for each crashed worker, where it dies and on which of its calls."""
    spread = max(2, 2 * messages // (crashes + 1))  # so the crashes spread over the whole run
    draw = rng(seed, "crashlab")
    plan = [(draw.choice(list(points)), draw.randint(1, spread - 1)) for _ in range(crashes)]
    # Every planned kill must fall on a message: the workers before the last one may not use them all up.
    while sum(call for _, call in plan) > messages and any(call > 1 for _, call in plan):
        i = max(range(len(plan)), key=lambda j: plan[j][1])
        plan[i] = (plan[i][0], plan[i][1] // 2)
    return plan


async def run(
    handler: Callable[..., Any],
    *,
    messages: int = 200,
    crashes: int = 10,
    seed: int = 1,
    points: tuple[str, ...] = ("before", "after"),
    msg_id: bool = False,
    republish: int = 0,
    timeout: float = 20.0,
) -> Result:
    """Publish `messages` orders, let workers running `handler` take them, kill `crashes` of them.

    `republish` orders are published a second time, as a producer retries after a lost PubAck;
    `msg_id` sends every publish with a `Nats-Msg-Id` header (the order id), so the stream drops
    those retries. Returns once every order is acked and every worker due to crash has crashed,
    or at `timeout` (a handler that never acks).
    """
    plan = schedule_for(seed, crashes, messages, points)
    keys = [order_key(i) for i in range(1, messages + 1)]
    keys += rng(seed, "crashlab:republish").sample(keys, republish)
    raw = await run_workers(
        handler, grader=__name__, stream=STREAM, subject=SUBJECT, payloads=[k.encode() for k in keys],
        headers=[{"Nats-Msg-Id": k} if msg_id else None for k in keys],
        plan=[[Crash(POINTS[point][0], call, POINTS[point][1])] for point, call in plan], seed=seed, timeout=timeout,
    )  # fmt: skip
    return Result(
        handler.__name__, messages, seed, plan, events_of(raw.rows, POINTS), raw.pids, raw.seconds,
        raw.published, raw.stored,
    )  # fmt: skip


@dataclass
class Comparison:
    """Several results side by side, as a table in a notebook."""

    results: list[Result]

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        return [(r.handler, r.messages, len(r.crashes), r.lost, r.duplicated) for r in self.results]

    def __repr__(self) -> str:
        lines = [f"{'handler':<22}{'orders':>8}{'crashes':>9}{'lost':>7}{'charged again':>15}"]
        lines += [f"{h:<22}{m:>8}{c:>9}{lost:>7}{dup:>15}" for h, m, c, lost, dup in self.rows()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "<tr><th>handler</th><th>orders</th><th>crashes</th><th>lost</th><th>charged again</th></tr>"
        body = "".join(
            f"<tr><td><code>{h}</code></td><td>{m}</td><td>{c}</td><td><b>{lost}</b></td><td><b>{dup}</b></td></tr>"
            for h, m, c, lost, dup in self.rows()
        )
        return f"<table>{head}{body}</table>"


def compare(*results: Result) -> Comparison:
    """Show results side by side: orders, crashes, lost, charged again."""
    return Comparison(list(results))


# --- the ack timer: two or three workers on one order ----------------------------------------


@dataclass
class TimerResult:
    """One order, the workers that held it, and what the broker says at the end."""

    handler: str
    events: list[Event]
    letters: dict[int, str]  # pid -> "A", "B", "C", in the order they started
    pending: int  # messages the consumer has not delivered yet
    ack_pending: int  # messages delivered and not acked: the consumer will redeliver them
    seconds: float

    @property
    def charges(self) -> int:
        """How many times the order was charged."""
        return sum(e.kind == "charge" for e in self.events)

    @property
    def deliveries(self) -> dict[str, int]:
        """Deliveries per worker letter."""
        got = Counter(self.letters[e.pid] for e in self.events if e.kind == "delivery" and e.pid in self.letters)
        return {letter: got[letter] for letter in self.letters.values()}

    @property
    def settled(self) -> bool:
        """The broker will never deliver the order again."""
        return self.pending == 0 and self.ack_pending == 0

    def story(self) -> list[str]:
        """What happened, one line per event, workers named A, B, C."""
        shown = [e for e in self.events if e.kind not in ("handled", "started") and (e.key or e.kind == "crash")]
        return [f"+{e.t:.2f}s worker {self.letters.get(e.pid, '?')}: {_describe(e)}" for e in shown]

    def summary(self) -> str:
        state = "settled: never delivered again" if self.settled else f"{self.ack_pending} delivery still unacked"
        return (
            f"{self.handler}: deliveries {self.deliveries}, charged {self.charges} time(s); broker: "
            f"pending {self.pending}, ack pending {self.ack_pending} ({state}); {self.seconds:.1f} s"
        )

    def __repr__(self) -> str:
        return self.summary()


async def timer_run(handler: Callable[..., Any], *, zombie: bool = False, timeout: float = 10.0) -> TimerResult:
    """One order, o-001. Worker A takes it; worker B starts once A has it.

    zombie=False: nothing is injected; the handler's own pace decides whether B gets a copy.
    zombie=True: A's `env.fraud_check` is held (A's whole process waits, as in a long GC pause or a
    frozen VM) until B, which gets the redelivery after ack_wait, has been SIGKILLed right before
    its charge; then A goes on. A third worker C is running by then, to take any redelivery.
    Returns once the broker has nothing pending or unacked and every live worker is idle.
    """
    folder, path = write_handler(handler)
    started = time.perf_counter()
    try:
        async with Run(__name__, path, 0) as lab:
            names = lab.names
            await TOPOLOGY.provision(lab.js, names)
            params = {"handler": handler.__name__, "stream_name": STREAM, "consumer": DURABLE}
            b_dead = asyncio.Event()
            first_check: list[int] = []

            async def fraud_check(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
                if zombie and not first_check:
                    first_check.append(child.pid)
                    await b_dead.wait()  # A stalls here until B is gone
                lab.record_effect(child, "fraud_check", key)

            lab.on("fraud_check", fraud_check)
            plans: list[list[Crash]] = [[], [Crash("charge", 1, "before")] if zombie else []] + ([[]] if zombie else [])
            workers = HeldSpawns(lab, "worker", lambda n: plans[n], len(plans), params=params)
            workers.prepare(len(plans))  # A, B and (for the zombie) C, released in that order
            await lab.js.publish(names.subject(SUBJECT), order_key(1).encode())
            a = await workers.release()
            assert a is not None
            await lab.wait_for(lambda: any(e.pid == a.pid for e in lab.log.events("note", "delivery")), timeout)
            b = await workers.release()
            assert b is not None
            c = None
            if zombie:
                await lab.wait_for(lambda: not b.alive, timeout)
                c = await workers.release()
                b_dead.set()
            letters = {a.pid: "A", b.pid: "B"} | ({c.pid: "C"} if c else {})

            async def finished() -> bool:
                notes = lab.log.events("note")
                for child in (a, b, c):
                    if child is not None and child.alive:
                        mine = [e.name for e in notes if e.pid == child.pid]
                        if mine.count("delivery") != mine.count("handled"):
                            return False
                return await TOPOLOGY.drained(lab)

            settled = await lab.wait_for(finished, timeout)
            info = await TOPOLOGY.info(lab)
            if not settled:
                raise TimeoutError(f"the run did not settle within {timeout} s: {info.num_ack_pending} unacked")
            rows = lab.log.events()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    events = events_of(rows, {"before": POINTS["before"]})
    return TimerResult(
        handler.__name__, events, letters, info.num_pending, info.num_ack_pending, time.perf_counter() - started
    )


# --- nak, term, max_deliver: counted in the notebook's own process ---------------------------


async def deliveries_in(
    js: Any,
    stream: str,
    subject: str,
    settle: Callable[[Any], Awaitable[Any]],
    *,
    seconds: float = 0.3,
    max_deliver: int = -1,
    name: str = "retry",
) -> tuple[int, bool]:
    """Publish one order on `subject` and answer every delivery with settle(msg) for `seconds`.

    Returns (deliveries seen, whether the consumer will deliver the order again). A durable
    `name` of its own, for new messages only, is made first and deleted afterwards.
    """
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    await js.add_consumer(
        stream,
        ConsumerConfig(
            durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT,
            max_deliver=max_deliver, deliver_policy=DeliverPolicy.NEW,
        ),
    )  # fmt: skip
    await js.publish(subject, b"o-950")
    sub = await js.pull_subscribe_bind(name, stream)
    deliveries, started = 0, time.monotonic()
    try:
        while (left := seconds - (time.monotonic() - started)) > 0:
            try:
                [msg] = await sub.fetch(1, timeout=max(0.01, left))
            except TimeoutError:
                break
            deliveries += 1
            await settle(msg)
        info = await js.consumer_info(stream, name)
        owed = bool(info.num_ack_pending + info.num_pending)
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(stream, name)
    return deliveries, owed
