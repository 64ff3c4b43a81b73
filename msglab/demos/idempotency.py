"""Lesson 03's plumbing: payments handled by real worker processes under real kills, and a race of two.

A cell defines the handler (the NATS and SQL calls it teaches stay in the cell) and runs it in one
line:

    result = await bench.run(handle, payments=20, kill={"after_charge": 5})

`bench.run` publishes the payments to a JetStream stream and runs the handler in worker processes
of its own (the grading harness, as in lesson 02: msglab.demos.delivery_guarantees.run_workers),
one after another. In a worker, `env.db` is a sqlite3 connection to the shop's database (WAL,
waiting on locks), `env.gateway` the subject of the course's payment gateway (msglab.world.gateway,
served for the run over NATS, its store kept across runs), and `env.kill_point("after_charge", p)`
the place where the run may SIGKILL the process: `kill={"after_charge": 5}` kills five workers
there, each on a call drawn from the seed; an open transaction dies with the process, as it would.
The result counts, per payment, the charges in the gateway's store and the rows in the ledger.

`bench.race(handler, shop)` runs two workers at once on payments published twice, and holds each
worker at `env.hold(p)` until the other holds the same payment: the race always happens, at the
same line, whatever the handler does after it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msglab.broker import delete_streams
from msglab.demos.delivery_guarantees import fetch_loop, run_workers, write_handler
from msglab.grading.harness import Child, Run
from msglab.grading.nemesis import rng
from msglab.grading.sandbox import Sandbox
from msglab.grading.scaffold import HeldSpawns, held
from msglab.world import gateway as gw
from msglab.world.payments import ledger_counts, open_shop

STREAM = "PAYMENTS"
SUBJECT = "payments.received"
DURABLE = "payments"
GATEWAY_PREFIX = "lesson03.gateway"  # where the notebook itself talks to the gateway
KEY_WINDOW = gw.DEFAULT_WINDOW  # the gateway keeps idempotency keys 24 h, a common production figure
HOLD_WAIT = 3.0  # the longest a raced worker is held waiting for the other
LEDGER = "create table if not exists ledger (payment_id text not null, account text not null, cents integer not null)"


# --- what runs inside the worker processes ---------------------------------------------------


def _add_effects(env: Any) -> None:
    env.db = open_shop(env.params["db_path"])

    def kill_point(name: str, payment: dict[str, Any]) -> None:
        env.world.call(name, str(payment["payment_id"]))  # the run SIGKILLs the process here when planned

    def hold(payment: dict[str, Any]) -> None:
        env.world.call("hold", str(payment["payment_id"]))  # returns once the other worker holds it too

    env.kill_point = kill_point
    env.hold = hold


def _payment_id(msg: Any) -> str:
    try:
        return str(json.loads(msg.data)["payment_id"])
    except (ValueError, KeyError, TypeError):
        return msg.data.decode(errors="replace")[:40]


async def role_worker(env: Any, learner: Any) -> None:
    """One worker process: open the shop's database, wait held for its turn, handle payments."""
    _add_effects(env)
    held(env)
    await fetch_loop(env, getattr(learner, env.params["handler"]), _payment_id)


# --- the notebook's side ---------------------------------------------------------------------


@dataclass
class Result:
    """What one run did, per payment: from the gateway's store, the ledger table and the run's records."""

    handler: str
    payments: int
    deliveries: int
    kills: int
    charges: int  # charges the gateway made during this run, for these payments
    double_charged: int  # payments charged more than once at the gateway (this run or before)
    never_charged: int
    credited_twice: int  # payments with more than one ledger row
    never_credited: int
    seconds: float
    met: int = 0  # in a race: payments that both workers held at once
    batch: list[dict[str, Any]] = field(default_factory=list)  # the payments themselves, to publish again

    def __repr__(self) -> str:
        race = f", {self.met} held by both workers at once" if self.met else ""
        lines = [
            f"{self.handler}: {self.payments} payments, {self.deliveries} deliveries, {self.kills} workers "
            f"SIGKILLed{race} ({self.seconds:.1f} s)"
        ]
        if self.charges or self.double_charged or self.never_charged < self.payments:
            lines.append(
                f"  gateway: {self.charges} charges, double charged: {self.double_charged}, "
                f"never charged: {self.never_charged}"
            )
        lines.append(f"  ledger:  credited twice: {self.credited_twice}, never credited: {self.never_credited}")
        return "\n".join(lines)


class SlowGateway:
    """The course's gateway with a slow card network (`latency` s per charge), served in this kernel.

    `quiet()` returns once every charge request it received has been answered, so a cell can look
    at the store after a request timed out without guessing how long to wait.
    """

    def __init__(self, db_path: str, prefix: str, latency: float) -> None:
        self.store = gw.GatewayStore(db_path, KEY_WINDOW, latency=latency)
        self.view = gw.GatewayView(db_path, prefix, KEY_WINDOW)
        self.subject = self.view.subject
        self.in_flight = 0
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Any = None

    async def start(self, nc: Any) -> SlowGateway:
        from msglab.broker import settle_subscriptions

        async def on_charge(msg: Any) -> None:
            task = asyncio.ensure_future(self._charge(msg))  # requests overlap, as on a real server
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._sub = await nc.subscribe(self.subject, cb=on_charge)
        await settle_subscriptions(nc)
        return self

    async def _charge(self, msg: Any) -> None:
        self.in_flight += 1
        try:
            body = json.loads(msg.data)
            key = (msg.headers or {}).get(gw.KEY_HEADER) or None
            reference = str(body.get("reference", body.get("payment_id")))
            try:
                reply = await self.store.charge(str(body["account"]), int(body["cents"]), reference, key)
            except gw.GatewayError as exc:
                reply = {"error": str(exc), "status": exc.status, "code": exc.code}
            await msg.respond(json.dumps(reply).encode())
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    async def quiet(self, timeout: float = 5.0) -> None:
        """Return once no charge request is in flight."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.in_flight == 0), timeout)

    def charges(self, reference: str) -> list[gw.Charge]:
        """The charges the gateway made for one payment (its own store)."""
        return self.view.charges(reference)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class PaymentBench:
    """The shop's database, the gateway's store, and the runs: everything lesson 03 needs."""

    def __init__(self, nc: Any, js: Any, folder: str) -> None:
        self.nc = nc
        self.js = js
        self.folder = folder
        self.db_path = os.path.join(folder, "shop.sqlite")
        self.gateway_db = os.path.join(folder, "gateway.sqlite")
        self.gateway: gw.AttachedGateway | None = None
        self.slow: list[SlowGateway] = []
        self.runs = 0
        self.shops = 0

    @classmethod
    async def open(cls, nc: Any, js: Any) -> PaymentBench:
        """Create the ledger database and the gateway's store; serve the gateway to this notebook too."""
        bench = cls(nc, js, tempfile.mkdtemp(prefix="msglab-lesson03-"))
        atexit.register(shutil.rmtree, bench.folder, True)  # gone with the kernel, even if close() never runs
        db = open_shop(bench.db_path)
        db.execute(LEDGER)  # one row per credited payment, with no constraint: nothing stops a second row
        db.close()
        gw.open_store(bench.gateway_db).close()
        bench.gateway = await gw.attach(nc, bench.gateway_db, prefix=GATEWAY_PREFIX, window=KEY_WINDOW)
        return bench

    def payments(self, n: int, seed: int = 3) -> list[dict[str, Any]]:
        """n new payments with ids unique to this run, over four accounts."""
        self.runs += 1
        r = rng(seed, f"lesson03:{self.runs}")
        ids = [f"r{self.runs}-p{i:02d}" for i in range(1, n + 1)]
        return [{"payment_id": pid, "account": f"acct-{r.randint(1, 4)}", "cents": r.randint(100, 9999)} for pid in ids]

    def new_shop(self) -> Any:
        """A fresh shop database (ledger table only), as a sqlite_utils Database, for a race."""
        import sqlite_utils

        self.shops += 1
        path = os.path.join(self.folder, f"race-shop-{self.shops}.sqlite")
        db = open_shop(path)
        db.execute(LEDGER)
        db.commit()
        return sqlite_utils.Database(db)

    async def _serve_gateway(self, run: Run) -> dict[str, Any]:
        """For one run: the gateway on the run's own connection and names, with the lesson's store."""
        prefix = run.names.subject("gateway")
        await gw.attach(run.nc, self.gateway_db, prefix=prefix, window=KEY_WINDOW)
        return {"gateway": f"{prefix}.charge"}

    async def run(
        self,
        handler: Callable[..., Any],
        *,
        payments: int | list[dict[str, Any]] = 20,
        kill: dict[str, int] | None = None,
        seed: int = 3,
    ) -> Result:
        """Publish payments; run workers with `handler` until every message is acked; kill as planned; count."""
        started, since = time.perf_counter(), time.time()
        batch = self.payments(payments, seed) if isinstance(payments, int) else list(payments)
        plan = self.plan(kill or {}, [p["payment_id"] for p in batch], seed)
        raw = await run_workers(
            handler, grader=__name__, stream=STREAM, subject=SUBJECT,
            payloads=[json.dumps(p).encode() for p in batch], kill_at=plan,
            params={"db_path": self.db_path}, setup=self._serve_gateway, kernel_user=True, seed=seed,
        )  # fmt: skip
        deliveries = sum(1 for row in raw.rows if row.kind == "note" and row.name == "delivery")
        kills = sum(1 for row in raw.rows if row.kind == "crash")
        return self._count(handler.__name__, batch, self.db_path, deliveries, kills, since, started)

    def plan(self, kill: dict[str, int], ids: list[str], seed: int) -> list[tuple[str, str]]:
        """(point, payment id) pairs, drawn from the seed: n payments per point, each killed there once."""
        r = rng(seed, f"lesson03:plan:{self.runs}")
        return [(point, pid) for point, n in kill.items() for pid in r.sample(ids, n)]

    async def race(self, handler: Callable[..., Any], shop: Any, *, payments: int = 3, seed: int = 3) -> Result:
        """Two workers at once; each payment published twice, so each worker holds a copy; count the ledger."""
        started, since = time.perf_counter(), time.time()
        batch = self.payments(payments, seed)
        path = str(shop.execute("pragma database_list").fetchone()[2])
        folder, source = write_handler(handler)
        lab = Run(__name__, source, seed)
        lab.sandbox = Sandbox(why_not="a lesson's own experiment, run as the notebook's user")
        met: set[str] = set()
        try:
            async with lab:
                await _provision(lab)
                first: dict[str, int] = {}  # payment -> the pid of the worker that holds it first
                both: dict[str, asyncio.Event] = {}

                async def hold(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
                    pid = key or ""
                    pair = both.setdefault(pid, asyncio.Event())
                    if pid not in first:
                        first[pid] = child.pid
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(pair.wait(), HOLD_WAIT)  # until the other worker holds it
                    elif first[pid] != child.pid and not pair.is_set():
                        met.add(pid)
                        pair.set()  # both go on together

                lab.on("hold", hold)
                params = {"handler": handler.__name__, "stream_name": STREAM, "consumer": DURABLE, "db_path": path}
                spawns = HeldSpawns(lab, "worker", lambda n: [], 2, params=params)
                spawns.prepare(2)
                for p in batch:
                    for _ in range(2):  # the checkout published it twice: each worker takes one copy
                        await lab.js.publish(lab.names.subject(SUBJECT), json.dumps(p).encode())
                workers = [worker for worker in [await spawns.release(), await spawns.release()] if worker]

                async def done() -> bool:
                    notes = lab.log.events("note")
                    for worker in workers:
                        mine = [e.name for e in notes if e.pid == worker.pid]
                        if mine.count("delivery") != mine.count("handled"):
                            return False
                    info = await lab.js.consumer_info(lab.names.stream(STREAM), lab.names.durable(DURABLE))
                    return bool(info.num_pending == 0 and info.num_ack_pending == 0)

                if not await lab.wait_for(done, 20.0):
                    raise TimeoutError("the race did not finish within 20 s")
                deliveries = len(lab.log.events("note", "delivery"))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        result = self._count(handler.__name__, batch, path, deliveries, 0, since, started)
        result.met = len(met)
        return result

    def _count(
        self, name: str, batch: list[dict[str, Any]], db_path: str, deliveries: int, kills: int, since: float,
        started: float,
    ) -> Result:  # fmt: skip
        ids = [p["payment_id"] for p in batch]
        made = [c for c in gw.GatewayView(self.gateway_db, "", KEY_WINDOW).charges() if c.reference in set(ids)]
        charges = Counter(c.reference for c in made)
        rows = ledger_counts(db_path, ids)
        return Result(
            name, len(ids), deliveries, kills, charges=sum(c.ts >= since for c in made),
            double_charged=sum(charges[i] > 1 for i in ids), never_charged=sum(charges[i] == 0 for i in ids),
            credited_twice=sum(rows[i] > 1 for i in ids), never_credited=sum(rows[i] == 0 for i in ids),
            seconds=time.perf_counter() - started, batch=batch,
        )  # fmt: skip

    async def slow_gateway(self, latency: float) -> SlowGateway:
        """A gateway of its own (a separate store) whose every charge takes `latency` s, served in this kernel."""
        path = os.path.join(self.folder, f"slow-gateway-{len(self.slow)}.sqlite")
        gw.open_store(path).close()
        slow = await SlowGateway(path, f"lesson03.slow{len(self.slow)}", latency).start(self.nc)
        self.slow.append(slow)
        return slow

    async def close(self) -> None:
        """Stop the gateways served here, delete the lesson's streams, remove the databases."""
        for slow in self.slow:
            await slow.close()
        if self.gateway is not None:
            await self.gateway.stop()
        await cleanup(self.js)
        shutil.rmtree(self.folder, ignore_errors=True)


async def _provision(lab: Run) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig

    names = lab.names
    await lab.js.add_stream(name=names.stream(STREAM), subjects=[names.subject("payments.>")])
    await lab.js.add_consumer(
        names.stream(STREAM),
        ConsumerConfig(durable_name=names.durable(DURABLE), ack_policy=AckPolicy.EXPLICIT, ack_wait=0.5),
    )


async def cleanup(js: Any) -> list[str]:
    """Delete every LESSON03_ stream (a lesson run that was interrupted may have left some)."""
    return await delete_streams(js, "LESSON03_")
