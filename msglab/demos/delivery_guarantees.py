"""The lesson's crash experiment: a real worker process, SIGKILLed on a seeded schedule.

    async def ack_first(env, msg):
        await msg.ack_sync()
        await env.charge(msg.data.decode())

    result = await crashlab.run(ack_first, messages=200, crashes=10, seed=7)
    result.lost, result.duplicated

`run` ships the handler's source to worker processes of its own (`python -m msglab.grading.runner`
with this module as the "grader"), publishes `messages` orders to a stream with a durable, and
lets one worker after another handle them; each of the first `crashes` workers is SIGKILLed at
one point drawn from the seed: inside `env.charge` before or after the charge is committed, or
inside `env.done` (the step a handler calls right after acking). The same seed gives the same
schedule to every handler, so two orders of ack and work can be compared on equal terms.
Every delivery, charge, ack and crash is a row in the run's effect store (see effects.py);
`Result` holds them for counting and for `msglab.notebook.timeline`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msglab.grading.harness import Child, Run
from msglab.grading.nemesis import Crash, rng

STREAM = "ORDERS"
SUBJECT = "orders.charge"
DURABLE = "payments"
ACK_WAIT = 0.5  # seconds; production uses 30 s, an experiment cannot wait that long
POINTS = {  # where a worker can be killed, as nemesis plans name it
    "before": ("charge", "before"),  # inside env.charge, before the charge is committed
    "after": ("charge", "after"),  # inside env.charge, after the charge is committed
    "done": ("done", "after"),  # inside env.done, called right after the ack
}
WORDS = {"before": "before the charge", "after": "after the charge", "done": "right after the ack call returned"}


# --- what runs inside the worker processes ---------------------------------------------------


def _add_effects(env: Any) -> None:
    """env.charge (a real round trip, then the charge) and env.done: effects the run's grader side answers.

    The kill plan stays in the notebook's process: the worker only makes the calls, and the
    run SIGKILLs it when a planned call arrives (before or after recording the charge).
    """

    async def charge(order_id: str) -> None:
        await env.nc.flush()  # a call to a payment service takes a round trip; so does this one
        env.world.call("charge", order_id)

    def done(order_id: str) -> None:
        env.world.call("done", order_id)

    env.charge = charge
    env.done = done


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


async def role_worker(env: Any, learner: Any) -> None:
    """One worker process: wait for its turn, then fetch and hand each message to the handler."""
    _add_effects(env)
    handler = getattr(learner, env.params["handler"])
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.readline()  # started ahead of its turn; a line on stdin says go
    env.world.note("started", None)
    sub = await env.js.pull_subscribe_bind(env.durable(DURABLE), env.stream(STREAM))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=1)
        except TimeoutError:
            continue
        for msg in msgs:
            key = msg.data.decode()
            env.world.note("delivery", key, n=msg.metadata.num_delivered)
            _record_acks(env, msg, key)
            await handler(env, msg)
            env.world.note("handled", key)  # so the run can tell the last message is finished


# --- the experiment ---------------------------------------------------------------------------


@dataclass
class Event:
    """One thing that happened to one message (or to a worker, key None)."""

    t: float  # seconds since the run started
    kind: str  # delivery, charge, ack, crash, started
    key: str | None
    pid: int
    detail: dict[str, Any] = field(default_factory=dict)


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
        return f"SIGKILL {WORDS[event.detail['point']]}"
    return event.kind


def order_key(i: int) -> str:
    """The order id of message number i (1-based)."""
    return f"o-{i:03d}"


def schedule_for(seed: int, crashes: int, messages: int, points: tuple[str, ...]) -> list[tuple[str, int]]:
    """The seeded crash plan: for each crashed worker, where it dies and on which of its calls."""
    spread = max(2, 2 * messages // (crashes + 1))  # so the crashes spread over the whole run
    draw = rng(seed, "crashlab")
    plan = [(draw.choice(points), draw.randint(1, spread - 1)) for _ in range(crashes)]
    # Every planned kill must fall on a message: the workers before the last one may not use them all up.
    while sum(call for _, call in plan) > messages and any(call > 1 for _, call in plan):
        i = max(range(len(plan)), key=lambda j: plan[j][1])
        plan[i] = (plan[i][0], plan[i][1] // 2)
    return plan


def _write_handler(handler: Callable[..., Any]) -> tuple[str, str]:
    """Write the handler as a module (its source, plus the imports a lesson cell would have)."""
    folder = tempfile.mkdtemp(prefix="msglab-crashlab-")
    path = os.path.join(folder, "handler.py")
    head = "from __future__ import annotations\n\nimport asyncio\nimport json\nfrom typing import Any\n\n\n"
    Path(path).write_text(head + textwrap.dedent(inspect.getsource(handler)))
    return folder, path


async def run(
    handler: Callable[..., Any],
    *,
    messages: int = 200,
    crashes: int = 10,
    seed: int = 1,
    points: tuple[str, ...] = ("before", "after"),
    timeout: float = 20.0,
) -> Result:
    """Publish `messages` orders, let workers running `handler` take them, kill `crashes` of them.

    Returns once every order is acked and every worker that was due to crash has crashed, or at
    `timeout` (a handler that never acks).
    """
    from nats.js.api import AckPolicy, ConsumerConfig

    plan = schedule_for(seed, crashes, messages, points)
    folder, path = _write_handler(handler)
    started = time.perf_counter()
    async with Run(__name__, path, seed) as lab:
        stream, durable = lab.names.stream(STREAM), lab.names.durable(DURABLE)
        await lab.js.add_stream(name=stream, subjects=[lab.names.subject("orders.>")])
        await lab.js.add_consumer(
            stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT)
        )
        params = {"handler": handler.__name__}

        def spawn(i: int) -> asyncio.Task[Child]:
            faults = []
            if i < len(plan):
                point, call = plan[i]
                effect, when = POINTS[point]
                faults = [Crash(effect, call, when)]
            return asyncio.ensure_future(lab.spawn("worker", faults=faults, params=params))

        # Workers start a few turns ahead of their turn, so a restart after a kill is instant.
        ahead = 3
        waiting = [spawn(i) for i in range(min(ahead, len(plan) + 1))]
        await asyncio.gather(*(lab.js.publish(lab.names.subject(SUBJECT), order_key(i).encode())
                               for i in range(1, messages + 1)))  # fmt: skip
        pids: list[int] = []

        async def acked() -> bool:
            info = await lab.js.consumer_info(stream, durable)
            return info.num_ack_pending == 0 and info.num_pending == 0

        def idle(pid: int) -> bool:
            """The worker has finished every message it took (an ack may come before the work)."""
            notes = [e.name for e in lab.log.events("note") if e.pid == pid]
            return notes.count("delivery") == notes.count("handled")

        async def finished(pid: int) -> bool:
            return await acked() and idle(pid)

        deadline = time.monotonic() + timeout
        try:
            for i in range(len(plan) + 1):
                if i + ahead <= len(plan):
                    waiting.append(spawn(i + ahead))
                child = await waiting.pop(0)
                assert child.proc.stdin is not None
                child.proc.stdin.write(b"go\n")
                await child.proc.stdin.drain()
                pids.append(child.pid)
                remaining = max(0.1, deadline - time.monotonic())
                if i < len(plan):
                    # A worker due to crash runs until it does (or until nothing is left to do).
                    await lab.wait_for(lambda c=child: not c.alive or acked(), remaining)  # type: ignore[misc]
                    await child.kill()
                else:
                    await lab.wait_for(lambda c=child: finished(c.pid), remaining)  # type: ignore[misc]
        finally:
            for task in waiting:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: the first failure is already on its way up
                task.cancel()
        rows = lab.log.events()
    shutil.rmtree(folder, ignore_errors=True)
    t0 = rows[0].ts if rows else 0.0
    events = []
    for row in rows:
        if row.kind == "crash":
            point = next(p for p, spot in POINTS.items() if spot == (row.name, row.detail.get("when")))
            events.append(Event(row.ts - t0, "crash", row.key, row.pid, {"point": point}))
        elif row.name != "done":  # an effect (charge) or a note (delivery, ack, started), by its name
            events.append(Event(row.ts - t0, row.name, row.key, row.pid, row.detail))
    return Result(handler.__name__, messages, seed, plan, events, pids, time.perf_counter() - started)


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
