"""The shop's fulfilment of lesson 05 and its lab: the workers on the durable, how the queue's depth
and age are measured, and the status rule.

One model for the lesson demo (msglab.demos.backpressure runs a pool in each worker process it
starts), the lab's grader (msglab.graders.backpressure runs one in its own process, so it knows to
the millisecond when each order was acked and judges the learner's age against it) and the lab's
playground, so what the lesson teaches and what the grader judges cannot drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

ACK_CONFIRM = 10.0  # seconds a worker waits for the broker to confirm its ack (nats-py's default is 1 s)


class Sample(NamedTuple):
    """One reading of a monitor: when (time.time()), the queue's age (seconds) and its depth (orders)."""

    t: float
    age: float
    depth: int


def status(samples: Sequence[Sequence[float]], budget: float) -> str:
    """OK / WARNING / ERROR from (t, age, ...) samples, oldest first: the level, then the trend.

    ERROR at or over the budget (the promise is broken now); WARNING when the age grew by at least
    half the window's span (the oldest order ages at least half as fast as the clock). Depth plays no part.
    """
    (t0, age0), (t1, age1) = samples[0][:2], samples[-1][:2]
    if age1 >= budget:
        return "ERROR"
    if t1 > t0 and age1 - age0 >= 0.5 * (t1 - t0):
        return "WARNING"
    return "OK"


async def depth_and_age(js: Any, stream: str, durable: str, subject: str) -> tuple[int, float]:
    """(queue depth, queue age in seconds) of one durable, as the course measures them.

    Depth: num_pending + num_ack_pending. Age: now minus the stored time of the first message after
    the durable's ack floor, on the durable's own subject (a delivered but unacked order counts).
    """
    from nats.js.errors import NotFoundError

    info = await js.consumer_info(stream, durable)
    depth = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    try:
        oldest = await js.get_msg(stream, info.ack_floor.stream_seq + 1, subject=subject, next=True)
    except NotFoundError:
        return depth, 0.0
    return depth, max(0.0, time.time() - oldest.time.timestamp())


@dataclass
class Handled:
    """One order message as the fulfilment workers saw it."""

    seq: int
    ts: float  # when the stream stored it (the server's clock)
    order_id: str | None
    ack_sent: float = math.inf  # time.time(): the ack left the worker ...
    ack_done: float = math.inf  # ... and the server confirmed it


def order_id(data: bytes) -> str | None:
    """The "id" of an order message, None when the body is not an order."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        return str(body["id"])
    return None


class Fulfilment:
    """The shop's fulfilment workers on one durable, as tasks of one process.

    `scale(n, work)` sets how many take orders at once and how long each order takes; `scale(0)`
    stalls them (an order in hand is finished). `slots` bounds the calls to the warehouse API that
    run at once (0: no bound). An order whose id is in `stuck` is held, unacked, by the worker that
    took it until `release()`; with `progress`, that worker tells the broker every `progress`
    seconds that it is still on it (so a short ack_wait never redelivers it), and `on_hold` hears the
    order's id and which delivery of it that is. `seen` records when each order was stored and acked.
    """

    def __init__(self, js: Any, stream: str, durable: str, *, slots: int = 0, progress: float = 0.0) -> None:
        self.js = js
        self.stream = stream
        self.durable = durable
        self.active = 0
        self.work = 0.0
        self.busy = 0
        self.slots = asyncio.Semaphore(slots) if slots else None
        self.progress = progress
        self.stuck: set[str] = set()
        self.seen: dict[int, Handled] = {}
        self.held: list[Any] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._jobs: set[asyncio.Task[None]] = set()
        self._release = asyncio.Event()
        self.closed = False
        self.parked = False  # the fetcher waits for a free worker: no fetch of ours is under way
        self.on_hold: Callable[[str, int], None] | None = None  # told each stuck order a worker holds, and its delivery

    async def start(self, workers: int = 2, work: float = 0.0) -> Fulfilment:
        self.sub = await self.js.pull_subscribe_bind(self.durable, self.stream)
        self.scale(workers, work)
        self._task = asyncio.ensure_future(self._fetch())
        return self

    def scale(self, workers: int, work: float | None = None) -> None:
        """Let `workers` workers take orders (0 stalls them all), each spending `work` seconds on one."""
        self.active = max(0, int(workers))
        if work is not None:
            self.work = float(work)
        self._poke()

    async def settle(self, deadline: float) -> None:
        """Return once no more workers hold an order than may (stalled: none, and no fetch under way),
        or after `deadline` seconds."""
        end = time.monotonic() + deadline
        while not (self.busy <= self.active and (self.active or self.parked)) and time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, end - time.monotonic()))

    async def stall(self, deadline: float = 3.0) -> None:
        """Stop taking orders, and return once no worker holds one and no fetch is under way."""
        self.scale(0)
        await self.settle(deadline)

    def release(self) -> None:
        """Let go of every held order: the worker finishes it and acks it."""
        self.stuck.clear()
        self._release.set()

    @property
    def idle(self) -> bool:
        return self.busy == 0

    async def close(self, patience: float = 3.0) -> None:
        self.closed = True
        self._release.set()
        tasks = [t for t in [self._task, *self._jobs] if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: nats-py 2.16 can swallow a cancellation inside a publish or an ack
            await asyncio.wait(tasks, timeout=patience)

    def _poke(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _fetch(self) -> None:
        while not self.closed:
            free = self.active - self.busy
            if free <= 0:
                self.parked = True
                self._poke()  # whoever waits for the workers to settle
                await self._changed.wait()
                self.parked = False
                continue
            try:
                msgs = await self.sub.fetch(min(free, 32), timeout=0.1)
            except TimeoutError:
                continue
            except Exception:  # the run is over (connection closed, stream deleted)
                if self.closed or self.js._nc.is_closed:
                    return
                await asyncio.sleep(0.05)
                continue
            for msg in msgs:
                self.busy += 1
                job = asyncio.ensure_future(self._handle(msg))
                self._jobs.add(job)
                job.add_done_callback(self._jobs.discard)

    async def _handle(self, msg: Any) -> None:
        try:
            meta = msg.metadata
            seq = meta.sequence.stream
            record = self.seen.get(seq)
            if record is None:
                record = self.seen[seq] = Handled(seq, meta.timestamp.timestamp(), order_id(msg.data))
            if record.order_id in self.stuck:
                self.held.append(msg)
                if self.on_hold is not None:
                    self.on_hold(record.order_id, int(meta.num_delivered))
                await self._hang(msg)
            if self.slots is not None:
                async with self.slots:  # the warehouse API takes this many calls at once
                    await asyncio.sleep(self.work)
            elif self.work:
                await asyncio.sleep(self.work)
            sent = time.time()
            # Not nats-py's 1 s default: on a loaded machine the confirmation can come later, and an ack
            # the broker has but the record lacks would make the grader's truth wrong.
            await msg.ack_sync(timeout=ACK_CONFIRM)
            record.ack_sent, record.ack_done = sent, time.time()
        except Exception:  # the run is over
            pass
        finally:
            self.busy -= 1
            self._poke()

    async def _hang(self, msg: Any) -> None:
        """The worker is stuck on this order (a call that never succeeds) until `release()`."""
        while not self._release.is_set():
            if not self.progress:
                await self._release.wait()
                return
            # "Still on it", at once and then every `progress` s: the broker does not deliver it again. At once,
            # since on a loaded machine the delivery can have waited in this process for much of ack_wait.
            await msg.in_progress()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), self.progress)
