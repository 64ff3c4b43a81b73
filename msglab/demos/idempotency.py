"""Lesson 03's plumbing: publish payments, run a payment handler under planned kills, count the damage.

A cell defines the handler (the NATS and SQL calls it teaches stay in the cell) and runs it in one
line:

    result = await bench.run(handle, payments=20, kill={"after_charge": 5})

Workers run in the notebook's own process, one message at a time, bound to a durable on a real
JetStream stream. `kill_point("after_charge", payment)` in a handler is where the plan may kill the
worker: it raises `Killed`, the worker drops the message without an ack (its open transaction rolls
back, as a SIGKILL's would) and a fresh worker takes its place. Each planned kill happens once. The
broker redelivers after ack_wait; the result counts charges from the gateway's own store and
credits from the ledger table, per payment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from msglab.broker import delete_stream, delete_streams
from msglab.grading.nemesis import rng
from msglab.world import gateway as gw

STREAM = "LESSON03_PAYMENTS"
SUBJECT = "lesson03.payments"
DURABLE = "lesson03_worker"
GATEWAY_PREFIX = "lesson03.gateway"
ACK_WAIT = 0.5  # seconds; production uses 30 s, a lesson cannot wait that long
MEET_WAIT = 3.0  # the longest a raced worker waits for the second one
RUN_TIMEOUT = 20.0

Handler = Callable[[Any, sqlite3.Connection], Awaitable[None]]

_gateway: gw.Gateway | None = None
_active: _RunState | None = None


class Killed(BaseException):
    """The planned kill of a worker: a BaseException, so no `except Exception` in a handler can swallow it."""


def start_gateway(hours: float = 24.0) -> gw.Gateway:
    """Start the lesson's payment gateway process (keys kept `hours`), stopping one this kernel started before."""
    global _gateway
    if _gateway is not None:
        _gateway.stop()
    _gateway = gw.start(prefix=GATEWAY_PREFIX, window=hours * 3600)
    return _gateway


def kill_point(name: str, payment: dict[str, Any]) -> None:
    """The worker may be killed here: raise Killed if this run's plan names this point for this payment."""
    if _active is not None:
        _active.maybe_kill(name, str(payment["payment_id"]))


async def meet(payment: dict[str, Any]) -> None:
    """Wait here until a second worker holds the same payment (a raced run only; returns at once otherwise)."""
    if _active is not None and _active.race:
        await _active.meet(str(payment["payment_id"]))


@dataclass
class _RunState:
    plan: set[tuple[str, str]]
    race: bool
    fired: set[tuple[str, str]] = field(default_factory=set)
    arrived: Counter[str] = field(default_factory=Counter)
    pairs: dict[str, asyncio.Event] = field(default_factory=dict)  # set once two workers hold the payment
    deliveries: int = 0
    busy: int = 0

    def maybe_kill(self, name: str, payment_id: str) -> None:
        """Raise Killed the first time the plan's point is reached for this payment."""
        if (name, payment_id) in self.plan and (name, payment_id) not in self.fired:
            self.fired.add((name, payment_id))
            raise Killed(f"worker killed at {name} while handling {payment_id}")

    async def meet(self, payment_id: str) -> None:
        """Return once two workers have arrived for this payment (or MEET_WAIT has passed)."""
        self.arrived[payment_id] += 1
        pair = self.pairs.setdefault(payment_id, asyncio.Event())
        if self.arrived[payment_id] >= 2:
            pair.set()
        # The other worker is another task of this loop; the broker sends it the payment after ack_wait.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pair.wait(), MEET_WAIT)


@dataclass
class Result:
    """What one run did, per payment: from the gateway's store, the ledger table and the stream."""

    payments: int
    published: int  # messages published (payments plus republished copies)
    stored: int  # messages the stream kept (Nats-Msg-Id duplicates are dropped)
    deliveries: int
    kills: int
    charges: int  # charges made during this run
    double_charged: int  # payments charged more than once at the gateway (in all, this run or before)
    never_charged: int
    credited_twice: int  # payments with more than one ledger row
    never_credited: int
    seconds: float
    batch: list[dict[str, Any]] = field(default_factory=list)  # the payments themselves, to publish again

    def __repr__(self) -> str:
        lines = [
            f"{self.payments} payments, {self.published} published, {self.stored} stored, "
            f"{self.deliveries} deliveries, {self.kills} workers killed ({self.seconds:.1f} s)"
        ]
        if self.charges or self.double_charged or self.never_charged < self.payments:
            lines.append(
                f"  gateway: {self.charges} charges, double charged: {self.double_charged}, "
                f"never charged: {self.never_charged}"
            )
        lines.append(f"  ledger:  credited twice: {self.credited_twice}, never credited: {self.never_credited}")
        return "\n".join(lines)


class PaymentBench:
    """A payment stream, a durable, the ledger database and the gateway: everything a lesson run needs."""

    def __init__(self, nc: Any, js: Any, gateway: gw.Gateway, folder: str) -> None:
        self.nc = nc
        self.js = js
        self.gateway = gateway
        self.folder = folder
        self.db_path = os.path.join(folder, "shop.sqlite")
        self.runs = 0

    @classmethod
    async def open(cls, nc: Any, js: Any, gateway: gw.Gateway) -> PaymentBench:
        """Remove what an earlier run of the lesson left, and create the ledger database."""
        await cleanup(js)
        bench = cls(nc, js, gateway, tempfile.mkdtemp(prefix="msglab-lesson03-"))
        db = bench.connect()
        # The effect: one row per credited payment, with no constraint, so nothing stops a second row.
        db.execute(
            "create table if not exists ledger "
            "(payment_id text not null, account text not null, cents integer not null)"
        )
        db.close()
        return bench

    def connect(self) -> sqlite3.Connection:
        """A connection to the shop's database as a worker opens it: WAL, and waiting on locks, not failing."""
        db = sqlite3.connect(self.db_path, timeout=10)
        db.execute("pragma journal_mode=wal")
        db.execute("pragma busy_timeout=10000")
        return db

    def payments(self, n: int, seed: int = 3) -> list[dict[str, Any]]:
        """n new payments with ids unique to this run, over four accounts."""
        self.runs += 1
        r = rng(seed, f"lesson03:{self.runs}")
        ids = [f"r{self.runs}-p{i:02d}" for i in range(1, n + 1)]
        return [{"payment_id": pid, "account": f"acct-{r.randint(1, 4)}", "cents": r.randint(100, 9999)} for pid in ids]

    async def _fresh_stream(self, duplicate_window: float) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        await delete_stream(self.js, STREAM)  # purged first: a stream re-made at once can resurrect
        await self.js.add_stream(name=STREAM, subjects=[SUBJECT], duplicate_window=duplicate_window)
        await self.js.add_consumer(
            STREAM,
            ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT, max_ack_pending=100),
        )

    async def run(
        self,
        handler: Handler,
        *,
        payments: int | list[dict[str, Any]] = 20,
        kill: dict[str, int] | None = None,
        workers: int = 1,
        republish: int = 0,
        msg_id: bool = False,
        race: bool = False,
        seed: int = 3,
    ) -> Result:
        """Publish payments, run `workers` workers with `handler` until every message is acked, and count.

        kill: {point: how many payments} to kill a worker at kill_point(point, payment), each once;
        republish: publish that many payments a second time; msg_id: set Nats-Msg-Id to the payment
        id; race: meet() holds each worker until a second worker has the same payment.
        """
        global _active
        started, since = time.perf_counter(), time.time()
        batch = self.payments(payments, seed) if isinstance(payments, int) else list(payments)
        ids = [p["payment_id"] for p in batch]
        r = rng(seed, f"lesson03:plan:{self.runs}")
        plan = {(point, pid) for point, n in (kill or {}).items() for pid in r.sample(ids, n)}
        copies = r.sample(batch, republish)
        await self._fresh_stream(duplicate_window=120.0)
        for p in batch + copies:
            headers = {"Nats-Msg-Id": p["payment_id"]} if msg_id else None
            await self.js.publish(SUBJECT, json.dumps(p).encode(), headers=headers)
        stored = (await self.js.stream_info(STREAM)).state.messages
        state = _RunState(plan, race)
        _active = state
        tasks: list[asyncio.Task[None]] = []
        try:
            # One list for the whole run: a killed worker appends its replacement here, so all are stopped below.
            tasks.extend(asyncio.ensure_future(self._worker(handler, state, tasks)) for _ in range(workers))
            deadline = time.monotonic() + RUN_TIMEOUT
            while time.monotonic() < deadline:
                if await self._drained(state):
                    break
                await asyncio.sleep(0.02)  # polling the broker's own state, as graders' wait_for does
        finally:
            _active = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self._count(batch, len(batch) + len(copies), stored, state, since, time.perf_counter() - started)

    async def _drained(self, state: _RunState) -> bool:
        info = await self.js.consumer_info(STREAM, DURABLE)
        return info.num_pending == 0 and info.num_ack_pending == 0 and state.busy == 0

    async def _worker(self, handler: Handler, state: _RunState, tasks: list[asyncio.Task[None]]) -> None:
        db = self.connect()
        sub = await self.js.pull_subscribe_bind(DURABLE, STREAM)
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=1, timeout=0.1)
                except TimeoutError:
                    continue
                for msg in msgs:
                    state.deliveries += 1
                    state.busy += 1
                    try:
                        await handler(msg, db)
                    except Killed:
                        # This worker is dead: no ack, its transaction rolled back; a fresh one takes over.
                        tasks.append(asyncio.ensure_future(self._worker(handler, state, tasks)))
                        return
                    finally:
                        state.busy -= 1
        finally:
            await sub.unsubscribe()
            db.close()

    def _count(
        self, batch: list[dict[str, Any]], published: int, stored: int, state: _RunState, since: float, seconds: float
    ) -> Result:
        ids = [p["payment_id"] for p in batch]
        made = [c for c in self.gateway.charges() if c.reference in set(ids)]
        charges = Counter(c.reference for c in made)
        db = self.connect()
        try:
            marks = ",".join("?" * len(ids))
            found = db.execute(f"select payment_id from ledger where payment_id in ({marks})", ids)
            rows = Counter(r[0] for r in found)
        finally:
            db.close()
        return Result(
            payments=len(ids), published=published, stored=stored, deliveries=state.deliveries, kills=len(state.fired),
            charges=sum(c.ts >= since for c in made), double_charged=sum(charges[i] > 1 for i in ids),
            never_charged=sum(charges[i] == 0 for i in ids), credited_twice=sum(rows[i] > 1 for i in ids),
            never_credited=sum(rows[i] == 0 for i in ids), seconds=seconds, batch=batch,
        )  # fmt: skip

    async def close(self) -> None:
        """Delete the lesson's streams, stop the gateway, remove the database."""
        await cleanup(self.js)
        self.gateway.stop(remove=True)
        shutil.rmtree(self.folder, ignore_errors=True)


async def cleanup(js: Any) -> list[str]:
    """Delete every LESSON03_ stream (a lesson run that was interrupted may have left some)."""
    return await delete_streams(js, "LESSON03_")
