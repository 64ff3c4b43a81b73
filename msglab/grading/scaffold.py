"""The run scaffold graders (and lesson demos) share: the lab's topology, held spawns, phases, traces.

    Topology     the stream, its durable and subjects: provisioning, consumer_info, "drained?", a BrokerWatch
    HeldSpawns   learner processes started ahead of their turn and released one by one (a restart then
                 costs milliseconds, not a Python start-up); the learner's side waits in `held(env)`
    Phases       named phases of a workload; each start is logged, so a trace can say which phase a step was in
    Trace        one trace builder: (timestamp, text) steps, sorted, stamped with the run's clock, squashed

A workload then reads top-down: provision, prepare spawns, one `async with phases("...")` block
after another, then the checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from msglab.grading.rules import drained, squash

if TYPE_CHECKING:
    from msglab.grading.harness import Child, Run
    from msglab.grading.labkit import Names
    from msglab.grading.nemesis import Crash
    from msglab.grading.observe import BrokerWatch

HELD = "held"  # the effect a held learner process blocks in until the grader releases it


@dataclass(frozen=True)
class Topology:
    """A lab's stream and durable: what the platform team provisions before any learner code runs."""

    stream: str  # e.g. "BILLING"
    wildcard: str  # what the stream stores, e.g. "billing.>"
    durable: str  # e.g. "invoicer"
    subject: str  # what the durable delivers, e.g. "billing.invoice" ("": all the stream holds)
    ack_wait: float
    consumer: dict[str, Any] = field(default_factory=dict)  # more ConsumerConfig fields (max_ack_pending, ...)

    async def provision(self, js: Any, names: Names) -> None:
        """Create the stream and its durable (names isolated per run)."""
        from msglab.grading.labkit import provision

        if not self.subject:  # no filter: the durable delivers every subject the stream stores
            from nats.js.api import AckPolicy, ConsumerConfig

            await js.add_stream(name=names.stream(self.stream), subjects=[names.subject(self.wildcard)])
            config = ConsumerConfig(
                durable_name=names.durable(self.durable), ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait,
                **self.consumer,
            )  # fmt: skip
            await js.add_consumer(names.stream(self.stream), config)
            return
        await provision(
            js, names, stream=self.stream, wildcard=self.wildcard, durable=self.durable, subject=self.subject,
            ack_wait=self.ack_wait, **self.consumer,
        )  # fmt: skip

    async def info(self, run: Run) -> Any:
        """The durable's consumer_info, as the broker reports it now."""
        return await run.js.consumer_info(run.names.stream(self.stream), run.names.durable(self.durable))

    async def drained(self, run: Run) -> bool:
        """Nothing undelivered and nothing delivered-but-unacked on the durable."""
        return drained(await self.info(run))

    async def watch(self, run: Run, kind: type[BrokerWatch] | None = None) -> Any:
        """A started BrokerWatch (or subclass `kind`) on this durable: the broker's view of acks and pulls."""
        from msglab.grading.observe import BrokerWatch

        watch = (kind or BrokerWatch)(run.names.stream(self.stream), run.names.durable(self.durable))
        return await watch.start(run.nc)

    async def publish(self, run: Run, body: bytes, subject: str | None = None, key: str | None = None) -> int:
        """Publish as the grader (on the durable's subject unless told); return the sequence the stream confirmed.

        `key`, the message's business key, is registered first as the run's workload (Run.workload).
        """
        if key is not None:
            run.workload.add(key)  # before the publish: a worker may call about it before the ack is back
        ack = await run.js.publish(run.names.subject(subject or self.subject), body)
        return int(ack.seq)


def gone(child: Child) -> bool:
    """The process ended, or is ending on its own (it raised or returned: the exit is on its way)."""
    return not child.alive or child.died is not None or child.returned


def held(env: Any) -> None:
    """In the learner's process: block until the grader releases this process (see HeldSpawns)."""
    env.world.call(HELD)


class HeldSpawns:
    """Learner processes of one role, started ahead of their turn, released in order.

    The role function calls `held(env)` before the learner's code; `release()` answers that call.
    `faults(n)` gives the n-th process's crash plan (0-based); at most `limit` processes in all.
    `ended` maps each stopped process to when it ended (its crash's time, for a crash): rule 6's evidence.
    """

    def __init__(
        self,
        run: Run,
        role: str,
        faults: Callable[[int], list[Crash]],
        limit: int,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.run, self.role, self.faults, self.limit = run, role, faults, limit
        self.params = params  # what each process's env carries besides connections and names (run.spawn's params)
        self.released: list[Child] = []
        self.waiting: list[asyncio.Task[Child]] = []
        self.ended: dict[int, float] = {}
        self._gates: dict[int, asyncio.Event] = {}
        run.on(HELD, self._hold)

    async def _hold(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        await self._gates.setdefault(child.pid, asyncio.Event()).wait()

    def prepare(self, count: int) -> None:
        """Start `count` more processes (they wait held); never more than `limit` in all."""
        for _ in range(count):
            number = len(self.released) + len(self.waiting)
            if number >= self.limit:
                return
            spawn = self.run.spawn(self.role, faults=self.faults(number), params=self.params)
            self.waiting.append(asyncio.ensure_future(spawn))

    async def release(self) -> Child | None:
        """Release the next process (starting one if none waits); None once `limit` is reached."""
        if not self.waiting:
            self.prepare(1)
        if not self.waiting:
            return None
        child = await self.waiting.pop(0)
        self._gates.setdefault(child.pid, asyncio.Event()).set()
        self.released.append(child)
        return child

    async def stop(self, child: Child) -> None:
        """End a process whose turn is over; one that raised or returned is let to exit by itself (rule 3 sees it)."""
        if child.died is not None or child.returned:
            await child.wait_exit(2.0)
        if child.alive:
            await child.kill()
        self.note_end(child)

    def note_end(self, child: Child) -> None:
        """Record when an ended process ended: its crash's time if the nemesis killed it, else now."""
        if child.pid in self.ended or child.alive:
            return
        crash = next((e for e in self.run.log.events("crash") if e.pid == child.pid), None)
        self.ended[child.pid] = crash.ts if crash else time.time()

    async def settle(self) -> None:
        """At the run's end: let the processes that raised or returned exit (so rule 3 sees them), note every end."""
        for child in self.released:
            if child.died is not None or child.returned:
                await child.wait_exit(2.0)
            self.note_end(child)

    async def cancel(self) -> None:
        """Stop starting processes nobody will release (the run's end kills those already started)."""
        for task in self.waiting:
            task.cancel()
        await asyncio.gather(*self.waiting, return_exceptions=True)
        self.waiting.clear()


class Phases:
    """Named phases of a workload; `async with phases("crash 1"):` logs its start in the run's effect log."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.current = ""

    @contextlib.asynccontextmanager
    async def __call__(self, name: str) -> AsyncIterator[None]:
        self.current = name
        self.run.log.record("phase", name, None)
        yield

    def started(self) -> list[tuple[float, str]]:
        """(timestamp, name) of every phase begun so far."""
        return [(e.ts, e.name) for e in self.run.log.events("phase")]

    def at(self, ts: float) -> str:
        """The phase running at that timestamp ('' before the first)."""
        name = ""
        for start, phase in self.started():
            if start <= ts:
                name = phase
        return name


class Trace:
    """One trace builder: add (timestamp, text) steps in any order; `lines()` sorts, stamps and squashes them.

    A pinned step (`add(..., pin=True)`: one a check's message counts) is never cut from a long trace;
    `lines(pinned_are=...)` names them in the line that says what was cut (rules.squash)."""

    def __init__(self, run: Run, keep: int = 14) -> None:
        self.run, self.keep = run, keep
        self.steps: list[tuple[float, str]] = []
        self.pins: set[int] = set()  # indexes in steps

    def add(self, ts: float, text: str, *, pin: bool = False) -> Trace:
        if pin:
            self.pins.add(len(self.steps))
        self.steps.append((ts, text))
        return self

    def lines(self, *tail: str, pinned_are: str = "") -> list[str]:
        order = sorted(range(len(self.steps)), key=lambda i: self.steps[i][0])
        stamped = [f"{self.run.at(self.steps[i][0])} {self.steps[i][1]}" for i in order]
        pinned = [n for n, i in enumerate(order) if i in self.pins]
        return [*squash(stamped, self.keep, pinned, pinned_are), *tail]


async def while_moving(run: Run, condition: Any, progress: Any, first: float, *, stall: float, deadline: float) -> bool:
    """run.wait_for(condition) for `first` seconds, and on for as long as `progress()` changed within the last
    `stall` seconds, never past `deadline` (time.monotonic()): a busy machine slows a workload down, and only
    one that stopped moving is cut short. True if the condition held."""
    begin = moved = time.monotonic()
    seen = progress()
    while not await run.wait_for(condition, max(0.0, min(stall / 8, deadline - time.monotonic()))):
        now = time.monotonic()
        if (current := progress()) != seen:
            seen, moved = current, now
        if now >= deadline or (now >= begin + first and now >= moved + stall):
            return False
    return True
