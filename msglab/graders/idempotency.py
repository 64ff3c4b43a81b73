"""Lab 03 grader: a payment worker that charges each payment once, however often it is delivered.

Workload (seeded): the course's payment gateway (msglab.world.gateway, keys kept 24 h, its own store),
answering on NATS from the grader's process, and two worker processes running the learner's
`handle_payment` on the durable 'payments'. Ten payments over three accounts are published, and two
of them again as new messages with the same payment id (a producer retry the stream cannot
recognise). Four payments each get one injected SIGKILL, one at every point
of the handler: before the gateway call, after the gateway charged but before the database
transaction, after the first database commit, and after the handler returned but before the ack.
One more payment is delivered to both workers at once: the first worker to reach its first database
write is held there until the broker, its ack_wait over, redelivers the payment to the other worker
and that one reaches its first write too; then both go on together. A killed worker is replaced at
once.

Invariants judged on the gateway's store, the learner's database and the consumer (never printed
text): every payment charged exactly once; none lost (charged and recorded); every balance the sum
of its payments, each once; one stable idempotency key per payment at the gateway; nothing left
unacked.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from msglab.grading.harness import Child, Run
from msglab.grading.labkit import provision
from msglab.grading.nemesis import rng
from msglab.grading.runner import describe
from msglab.grading.verdict import Check
from msglab.world import gateway as gw

STREAM = "PAYMENTS"
SUBJECT = "payments.received"
DURABLE = "payments"
ACK_WAIT = 0.25  # seconds; production uses 30 s, a lab cannot wait that long
PAYMENTS = 10
ACCOUNTS = 3
REPUBLISHED = 2
WORKERS = 2  # kept alive at once: a killed worker is replaced at once
MAX_SPAWNS = 10  # a worker that dies on its own every time is not replaced forever
BARRIER_WAIT = 3.0  # the longest a worker is held waiting for the second worker to arrive
KEY_WINDOW = 24 * 3600.0  # the gateway keeps keys for the seeds' 24 h: nothing expires in a run
CATCH_UP = 6.0  # how long the workers have to settle everything
STUCK_AFTER = 3  # a message the handler raised on this many times is judged stuck

# Where a worker can be killed, in the order a handler meets them.
POINTS = {
    "before_charge": "killed before the gateway call",
    "after_charge": "killed after the gateway charged, before the database transaction",
    "after_commit": "killed right after its first database commit for this payment",
    "before_ack": "killed after handle_payment returned, before the ack",
}


# --- what runs inside the learner's processes ------------------------------------------------


@dataclass
class _Handling:
    """Which payment the worker is on, and what it has done to the database for it so far."""

    payment_id: str | None = None
    wrote: bool = False
    committed: bool = False
    plan: dict[str, Any] = field(default_factory=dict)


def _crash(env: Any, point: str, payment_id: str | None) -> None:
    """SIGKILL this worker if the plan puts `point` on this payment and no worker has died there yet.

    Fire-once across processes (the store says whether it fired), so a redelivery to the next worker
    goes through: every planned crash happens exactly once, whichever worker meets it.
    """
    if payment_id is None or [point, payment_id] not in env._plan["crashes"]:
        return
    fired = env.log.db.execute(
        "select count(*) from events where kind = 'crash' and name = ? and key = ?", (point, payment_id)
    ).fetchone()[0]
    if not fired:
        env.log.record("crash", point, payment_id)
        os.kill(os.getpid(), signal.SIGKILL)


def _barrier(env: Any, payment_id: str) -> None:
    """Hold this worker until a second worker reaches the same place for the same payment.

    Blocking on purpose: the first worker stops between its check and its write, and its ack_wait
    runs out, so the broker redelivers the payment to the other worker (a slow worker, a second
    delivery: the real-world race, made certain for every seed).
    """
    env.log.record("note", "race_arrived", payment_id)
    deadline = time.monotonic() + BARRIER_WAIT
    query = "select count(distinct pid) from events where kind = 'note' and name = 'race_arrived' and key = ?"
    while env.log.db.execute(query, (payment_id,)).fetchone()[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    env.log.record("note", "race_released", payment_id)


_WRITES = ("insert", "update", "delete", "replace", "begin", "with")


class _GradedDb(sqlite3.Connection):
    """The learner's sqlite3 connection, with the grader's hooks at writes and commits."""

    env: Any = None
    handling: _Handling = _Handling()
    changes_mark = 0  # total_changes at the last commit: how many rows each commit wrote

    def _before(self, sql: str) -> None:
        h = self.handling
        if h.payment_id is None or h.wrote or not sql.lstrip().lower().startswith(_WRITES):
            return
        h.wrote = True
        if h.payment_id == h.plan.get("race"):
            _barrier(self.env, h.payment_id)

    def _committed(self) -> None:
        h = self.handling
        if h.payment_id is None:
            return
        changed, self.changes_mark = self.total_changes - self.changes_mark, self.total_changes
        self.env.log.record("effect", "db_commit", h.payment_id, rows=changed)
        if not h.committed:
            h.committed = True
            _crash(self.env, "after_commit", h.payment_id)

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        self._before(sql)
        was_open = self.in_transaction
        cursor = super().execute(sql, parameters)
        if was_open and not self.in_transaction and sql.lstrip().lower().startswith(("commit", "end")):
            self._committed()
        return cursor

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        self._before(sql)
        return super().executemany(sql, parameters)

    def commit(self) -> None:
        was_open = self.in_transaction
        super().commit()
        if was_open:
            self._committed()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        was_open = self.in_transaction
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None and was_open:
            self._committed()
        return result


def open_shop_db(path: str) -> _GradedDb:
    """The shop's database as a worker sees it: WAL and a busy timeout, so two workers wait, not fail."""
    db: _GradedDb = sqlite3.connect(path, timeout=10, factory=_GradedDb)
    db.execute("pragma journal_mode=wal")
    db.execute("pragma busy_timeout=10000")
    return db


def _add_effects(env: Any, handling: _Handling) -> None:
    """Give env the lab's gateway call, with its crash points."""
    subject = env.subject("gateway.charge")

    async def charge(payment: dict[str, Any], idempotency_key: Any = None) -> dict[str, Any]:
        _crash(env, "before_charge", handling.payment_id)
        key = None if idempotency_key is None else str(idempotency_key)
        reply = await gw.charge(
            env.nc, subject, payment["account"], payment["cents"], reference=payment["payment_id"], idempotency_key=key
        )
        _crash(env, "after_charge", handling.payment_id)
        return reply

    env.charge = charge


async def role_payment_worker(env: Any, learner: Any) -> None:
    """One payment worker: fetch one message, run the learner's handler, ack; until killed."""
    handling = _Handling(plan=env._plan)
    db = open_shop_db(env.db_path)
    db.env, db.handling = env, handling
    env.db = db
    _add_effects(env, handling)
    learner.setup_db(db)
    if db.in_transaction:
        db.commit()  # setup_db may leave its DDL uncommitted; the other worker must see the tables
    sub = await env.js.pull_subscribe_bind(env.durable(DURABLE), env.stream(STREAM))
    source = os.environ.get("MSGLAB_SOURCE", "")
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            try:
                payment_id = str(json.loads(msg.data)["payment_id"])
            except (ValueError, KeyError, TypeError):
                payment_id = None
            meta = msg.metadata
            env.log.record("note", "delivered", payment_id, seq=meta.sequence.stream, delivery=meta.num_delivered)
            handling.payment_id, handling.wrote, handling.committed = payment_id, False, False
            db.changes_mark = db.total_changes
            try:
                await learner.handle_payment(env, msg)
            except Exception as exc:  # the learner's failure is data; no ack, so the broker redelivers
                if db.in_transaction:
                    db.rollback()
                env.log.record("note", "handler_error", payment_id, seq=meta.sequence.stream, **describe(exc, source))
                handling.payment_id = None
                continue
            _crash(env, "before_ack", payment_id)
            handling.payment_id = None
            with contextlib.suppress(Exception):  # already acked by the learner's own code: that is fine here
                await msg.ack_sync()
            env.log.record("note", "handled", payment_id)


async def playground(env: Any) -> None:
    """For the lab notebook: the same stream and durable, a gateway of its own, a fresh database.

    env.charge prints what the gateway did; env.gateway.charges() reads its store.
    """
    await _setup(env.js, env.names)
    folder = tempfile.mkdtemp(prefix="msglab-try03-")
    atexit.register(shutil.rmtree, folder, True)  # gone when the notebook's kernel exits
    gateway_db = os.path.join(folder, "gateway.sqlite")
    env.gateway = await gw.attach(env.nc, gateway_db, prefix=env.subject("gateway"), window=KEY_WINDOW)
    env.db = sqlite3.connect(os.path.join(folder, "shop.sqlite"), timeout=10)
    env.db.execute("pragma journal_mode=wal")
    env.db.execute("pragma busy_timeout=10000")

    async def charge(payment: dict[str, Any], idempotency_key: Any = None) -> dict[str, Any]:
        key = None if idempotency_key is None else str(idempotency_key)
        reply = await gw.charge(
            env.nc, env.gateway.subject, payment["account"], payment["cents"],
            reference=payment["payment_id"], idempotency_key=key,
        )  # fmt: skip
        what = "answered with its earlier charge" if reply["replayed"] else "charged"
        print(f"gateway {what} {reply['charge_id']} for {payment['payment_id']} (key {key!r})")
        return reply

    env.charge = charge


# --- the grader ------------------------------------------------------------------------------


@dataclass
class _Plan:
    payments: list[dict[str, Any]]
    order: list[dict[str, Any]]  # what is published, originals then republished copies
    crashes: dict[str, str]  # payment id -> point
    race: str
    republished: list[str]

    def params(self) -> dict[str, Any]:
        """What a worker process needs to know of the plan (it travels in MSGLAB_PARAMS)."""
        return {"crashes": [[point, pid] for pid, point in self.crashes.items()], "race": self.race}


def draw_plan(seed: int) -> _Plan:
    """The workload and its faults, all from the seed: `--seed N` replays the same plan."""
    r = rng(seed, "payments")
    payments = [
        {"payment_id": f"p-{i:02d}", "account": f"acct-{r.randint(1, ACCOUNTS)}", "cents": r.randint(100, 9999)}
        for i in range(1, PAYMENTS + 1)
    ]
    ids: list[str] = [str(p["payment_id"]) for p in payments]
    picks = rng(seed, "faults").sample(ids, 1 + len(POINTS) + REPUBLISHED)
    race, crashed, republished = picks[0], picks[1 : 1 + len(POINTS)], picks[1 + len(POINTS) :]
    crashes = dict(zip(crashed, POINTS, strict=True))
    rest = [p for p in payments if p["payment_id"] != race]
    rng(seed, "order").shuffle(rest)
    # The raced payment goes first, while both workers are idle: one takes it, the other gets the redelivery.
    first = next(p for p in payments if p["payment_id"] == race)
    copies = [p for p in payments if p["payment_id"] in republished]
    return _Plan(payments, [first, *rest, *copies], crashes, race, republished)


async def _setup(js: Any, names: Any) -> None:
    # The platform team's part: the stream and the durable exist before any worker starts.
    await provision(
        js, names, stream=STREAM, wildcard="payments.>", durable=DURABLE, subject=SUBJECT, ack_wait=ACK_WAIT,
        max_ack_pending=100,
    )  # fmt: skip


class _Pool:
    """Keeps WORKERS workers alive: a killed one is replaced at once (up to MAX_SPAWNS)."""

    def __init__(self, run: Run, params: dict[str, Any]) -> None:
        self.run = run
        self.params = params
        self.workers: list[Child] = []
        self.spawning = 0
        self.spawned = 0
        self.errors: list[BaseException] = []

    async def spawn(self) -> None:
        """Start one worker process; a failure to start is kept as evidence, not raised."""
        self.spawning += 1
        self.spawned += 1
        try:
            self.workers.append(await self.run.spawn("payment_worker", params=self.params))
        except BaseException as exc:  # a broken file is raised again by grade(); anything else is evidence
            self.errors.append(exc)
        finally:
            self.spawning -= 1

    @property
    def alive(self) -> list[Child]:
        """The worker processes still running."""
        return [w for w in self.workers if w.alive]

    def top_up(self) -> None:
        """Start replacements for dead workers in the background (the caller keeps polling)."""
        missing = WORKERS - len(self.alive) - self.spawning
        for _ in range(max(0, min(missing, MAX_SPAWNS - self.spawned))):
            self.run.tasks.append(asyncio.ensure_future(self.spawn()))


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    t0 = time.time()
    plan = draw_plan(run.seed)
    db_path = os.path.join(run.tmp, "shop.sqlite")
    await _setup(run.js, run.names)
    params = {"db_path": db_path, "_plan": plan.params()}
    # The gateway answers on the grader's own connection (one process fewer to start per verdict);
    # the workers reach it over NATS request-reply exactly as they would reach its own process.
    gateway_db = os.path.join(run.tmp, "gateway.sqlite")
    gateway = await gw.attach(run.nc, gateway_db, prefix=run.names.subject("gateway"), window=KEY_WINDOW)
    pool = _Pool(run, params)
    try:
        await asyncio.gather(*(pool.spawn() for _ in range(WORKERS)))
        for error in pool.errors:
            raise error
        return await _run_and_judge(run, plan, pool, gateway, db_path, t0)
    finally:
        await gateway.stop()


async def _run_and_judge(
    run: Run, plan: _Plan, pool: _Pool, gateway: gw.GatewayView, db_path: str, t0: float
) -> list[Check]:
    for payment in plan.order:
        await run.js.publish(run.names.subject(SUBJECT), json.dumps(payment).encode())

    stream, durable = run.names.stream(STREAM), run.names.durable(DURABLE)

    async def settled() -> bool:
        for error in pool.errors:
            raise error
        pool.top_up()
        info = await run.js.consumer_info(stream, durable)
        if info.num_pending or (info.num_ack_pending and info.num_ack_pending > _failing(run)):
            return False
        # Drained on the broker; also every delivery must have reached a worker's log and every
        # live worker must be idle, or a duplicate still in a handler would be missed.
        if run.log.count("note", "delivered") < info.delivered.consumer_seq:
            return False
        return all(_idle(run, w.pid) for w in pool.alive) or not pool.alive

    await run.wait_for(settled, CATCH_UP)
    info = await run.js.consumer_info(stream, durable)
    evidence = _Evidence.collect(run, plan, gateway, db_path, t0)
    return [
        _charged_once_check(evidence),
        _none_lost_check(evidence),
        _balances_check(evidence),
        _stable_key_check(evidence),
        _acked_check(info, pool, evidence),
    ]


def _failing(run: Run) -> int:
    """Messages the handler has raised on STUCK_AFTER times: they will not settle, so stop waiting for them."""
    rows = run.log.db.execute(
        "select count(*) from (select json_extract(detail, '$.seq') as seq from events "
        "where name = 'handler_error' group by seq having count(*) >= ?)",
        (STUCK_AFTER,),
    ).fetchone()
    return int(rows[0])


def _idle(run: Run, pid: int) -> bool:
    row = run.log.db.execute(
        "select name from events where pid = ? and name in ('delivered', 'handled', 'handler_error') "
        "order by id desc limit 1",
        (pid,),
    ).fetchone()
    return row is None or row[0] != "delivered"


@dataclass
class _Evidence:
    """Everything the checks judge, per payment, from the gateway's store, the learner's db and the log."""

    plan: _Plan
    charges: dict[str, list[gw.Charge]]
    keys: dict[str, list[str | None]]  # per payment: the key of every charge request, in order
    deliveries: dict[str, list[tuple[int, int]]]  # per payment: (stream seq, delivery count) of each
    rows: Counter[str]  # payment rows in the learner's db
    processed: set[str]  # payment ids found in the learner's processed table
    balances: dict[str, int] | None  # None when the table could not be read
    db_error: str
    raced: dict[str, int]  # payment id -> workers that held it at once
    errors: list[dict[str, Any]]
    traces: dict[str, list[str]]

    @classmethod
    def collect(cls, run: Run, plan: _Plan, gateway: gw.GatewayView, db_path: str, t0: float) -> _Evidence:
        def at(ts: float) -> str:
            return f"+{ts - t0:.2f}s"

        charges: dict[str, list[gw.Charge]] = defaultdict(list)
        for charge in gateway.charges():
            charges[charge.reference or ""].append(charge)
        keys: dict[str, list[str | None]] = defaultdict(list)
        traces: dict[str, list[tuple[float, str]]] = defaultdict(list)
        for request in gateway.requests():
            ref = request.reference or ""
            keys[ref].append(request.idempotency_key)
            key = "no key" if request.idempotency_key is None else f"key {request.idempotency_key!r}"
            what = "answered with its earlier charge" if request.replayed else "charged"
            traces[ref].append((request.ts, f"gateway {what} {request.charge_id} ({key})"))
        deliveries: dict[str, list[tuple[int, int]]] = defaultdict(list)
        raced: Counter[str] = Counter()
        errors = []
        first_seq: dict[str, int] = {}
        for event in run.log.events():
            pid_key = event.key or ""
            who = f"worker {event.pid}"
            if event.name == "delivered":
                seq, n = int(event.detail.get("seq", 0)), int(event.detail.get("delivery", 0))
                deliveries[pid_key].append((seq, n))
                first_seq.setdefault(pid_key, seq)
                copy = " (the republished copy)" if seq != first_seq[pid_key] else ""
                traces[pid_key].append((event.ts, f"delivered to {who}: stream seq {seq}, delivery {n}{copy}"))
            elif event.kind == "crash":
                traces[pid_key].append((event.ts, f"{who} {POINTS.get(event.name, event.name)} (injected)"))
            elif event.name == "db_commit":
                changed = event.detail.get("rows", 0)
                wrote = f"{changed} row{'s' if changed != 1 else ''} written" if changed else "nothing written"
                traces[pid_key].append((event.ts, f"{who} committed a database transaction ({wrote})"))
            elif event.name == "handled":
                traces[pid_key].append((event.ts, f"{who} acked it"))
            elif event.name == "race_arrived":
                raced[pid_key] += 1
                held = f"{who} reached its first database write; held until a second worker has it too"
                traces[pid_key].append((event.ts, held))
            elif event.name == "handler_error":
                errors.append({"payment": pid_key, **event.detail})
                where = f" at {event.detail.get('where')}" if event.detail.get("where") else ""
                traces[pid_key].append((event.ts, f"{who}: handle_payment raised {event.detail.get('error')}{where}"))
        rows: Counter[str] = Counter()
        processed: set[str] = set()
        balances: dict[str, int] | None = None
        db_error = ""
        try:
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)
            try:
                rows = Counter(r[0] for r in db.execute("select payment_id from payments"))
                balances = {r[0]: int(r[1]) for r in db.execute("select account, cents from balances")}
                try:
                    processed = {str(r[0]) for r in db.execute("select payment_id from processed")}
                except sqlite3.Error:
                    processed = set()
            finally:
                db.close()
        except sqlite3.Error as exc:
            db_error = f"{type(exc).__name__}: {exc}"
        ordered = {pid: [f"{at(ts)} {text}" for ts, text in sorted(steps)] for pid, steps in traces.items()}
        return cls(plan, charges, keys, deliveries, rows, processed, balances, db_error, dict(raced), errors, ordered)

    def ids(self) -> list[str]:
        """Every payment id, in plan order."""
        return [p["payment_id"] for p in self.plan.payments]

    def story_first(self, pids: list[str]) -> list[str]:
        """The payments to quote first: the incident's own story (killed after the gateway charged) leads."""
        order = list(POINTS)

        def rank(pid: str) -> tuple[int, int]:
            if pid in self.plan.crashes:
                point = self.plan.crashes[pid]
                return (0 if point == "after_charge" else 1, order.index(point))
            return (2 if self.raced.get(pid, 0) >= 2 else 3, 0)

        return sorted(pids, key=rank)

    def why_delivered(self, pid: str) -> str:
        """Why this payment came more than once, in words."""
        reasons = []
        if pid in self.plan.crashes:
            reasons.append(f"a worker was {POINTS[self.plan.crashes[pid]]}")
        if pid in self.plan.republished:
            reasons.append("it was published twice as two messages")
        if self.raced.get(pid, 0) >= 2:
            reasons.append("two workers had it at the same time")
        return "; ".join(reasons)

    def deliveries_text(self, pid: str) -> str:
        """'2 deliveries (stream seqs 3, 11)'."""
        seqs = sorted({s for s, _ in self.deliveries.get(pid, [])})
        seq_text = f"stream seq {seqs[0]}" if len(seqs) == 1 else f"stream seqs {', '.join(map(str, seqs))}"
        return f"{len(self.deliveries.get(pid, []))} deliveries ({seq_text})"


def _n(count: int, noun: str) -> str:
    """'1 payment was' / '3 payments were'."""
    return f"{count} {noun} was" if count == 1 else f"{count} {noun}s were"


def _first_error(ev: _Evidence) -> str:
    if not ev.errors:
        return ""
    e = ev.errors[0]
    where = f" at {e.get('where')}" if e.get("where") else ""
    raised = f"handle_payment raised {e.get('error')}({e.get('message')}){where}"
    return f"\n{raised} on {e['payment']} ({len(ev.errors)} times in all)."


def _charged_once_check(ev: _Evidence) -> Check:
    title = "every payment is charged at the gateway exactly once (no double charge)"
    twice = ev.story_first([pid for pid in ev.ids() if len(ev.charges.get(pid, [])) > 1])
    if not twice:
        return Check("charged_once", title, True)
    pid = twice[0]
    charges = ev.charges[pid]
    keys = ev.keys.get(pid, [])
    message = (
        f"{len(twice)} of {PAYMENTS} payments were charged more than once: {pid} was charged {len(charges)} times "
        f"({', '.join(c.charge_id for c in charges)}) over {ev.deliveries_text(pid)}; {ev.why_delivered(pid)}."
    )
    if any(k is None for k in keys):
        message += "\nIts charge requests carried no idempotency key, so the gateway took the retry for a new payment."
    elif len(set(keys)) > 1:
        message += (
            f"\nIts charge requests carried {len(set(keys))} different keys ({_keys_text(keys)}): "
            "every delivery looked new."
        )
    return Check(
        "charged_once", title, False, message, trace=ev.traces.get(pid, []),
        hint="pass env.charge(payment, idempotency_key=...) a key taken from the payment itself (its payment_id): "
        "the gateway then answers a repeat with the first charge",
    )  # fmt: skip


def _keys_text(keys: list[str | None]) -> str:
    distinct = list(dict.fromkeys(keys))
    return ", ".join("none" if k is None else repr(k) for k in distinct[:3]) + (" ..." if len(distinct) > 3 else "")


def _none_lost_check(ev: _Evidence) -> Check:
    title = "every payment is charged and recorded in your database (none lost)"
    if ev.db_error:
        return Check(
            "none_lost", title, False, f"the grader could not read the payments and balances tables: {ev.db_error}",
            hint="keep the payments and balances tables that setup_db creates; add processed beside them",
        )  # fmt: skip
    lost = ev.story_first([pid for pid in ev.ids() if not ev.charges.get(pid) or not ev.rows.get(pid)])
    if not lost:
        return Check("none_lost", title, True)
    pid = lost[0]
    if not ev.charges.get(pid) and not ev.rows.get(pid):
        what = "was never charged and never recorded"
    elif not ev.rows.get(pid):
        what = f"was charged at the gateway ({ev.charges[pid][0].charge_id}) but your payments table has no row for it"
    else:
        what = "is in your payments table but the gateway never charged it"
    message = f"{len(lost)} of {PAYMENTS} payments were lost: {pid} {what}, after {ev.deliveries_text(pid)}."
    if pid in ev.processed:
        message += (
            f"\nYet {pid} is in processed: its dedup record was committed without its effect, so every redelivery "
            "skipped it. A crash fell between two transactions."
        )
    message += _first_error(ev)
    return Check(
        "none_lost", title, False, message, trace=[*ev.traces.get(pid, []), "never recorded"],
        hint="record the key in processed and credit the payment in ONE transaction (one `with env.db:` block): "
        "a crash then leaves both or neither, and the redelivery redoes what was lost",
    )  # fmt: skip


def _balances_check(ev: _Evidence) -> Check:
    title = "each account's balance is the sum of its payments, each counted once"
    if ev.balances is None:
        return Check("balances_add_up", title, False, f"the grader could not read the balances table: {ev.db_error}",
                     hint="keep the balances table that setup_db creates")  # fmt: skip
    expected: Counter[str] = Counter()
    for p in ev.plan.payments:
        expected[p["account"]] += p["cents"]
    doubled = ev.story_first([pid for pid in ev.ids() if ev.rows.get(pid, 0) > 1])
    wrong = {a: (ev.balances.get(a, 0), cents) for a, cents in expected.items() if ev.balances.get(a, 0) != cents}
    if not doubled and not wrong:
        return Check("balances_add_up", title, True)
    by_id = {p["payment_id"]: p for p in ev.plan.payments}
    if doubled:
        pid = doubled[0]
        account = by_id[pid]["account"]
        got, want = ev.balances.get(account, 0), expected[account]
        message = (
            f"{_n(len(doubled), 'payment')} credited more than once: {pid} ({by_id[pid]['cents']} cents) is in your "
            f"payments table {ev.rows[pid]} times after {ev.deliveries_text(pid)}; {ev.why_delivered(pid)}. "
            f"{account} holds {got} cents, its payments add up to {want}."
        )
        if ev.raced.get(pid, 0) >= 2:
            message += (
                f"\nTwo workers had {pid} at once and both went on to credit it: a check that reads processed before "
                "inserting cannot see the other worker's insert. Only a unique key settles who was first."
            )
            hint = (
                "give processed a primary key and claim the key with insert ... on conflict (payment_id) do nothing "
                "inside the transaction; credit only when that insert added a row (rowcount 1)"
            )
        else:
            hint = (
                "in the transaction, insert the key into processed first and return without crediting "
                "when it was already there"
            )
        return Check("balances_add_up", title, False, message, trace=ev.traces.get(pid, []), hint=hint)
    account, (got, want) = next(iter(wrong.items()))
    missing = [pid for pid in ev.ids() if by_id[pid]["account"] == account and not ev.rows.get(pid)]
    message = f"{account} holds {got} cents; the payments to {account} add up to {want}."
    if missing:
        message += f" Not credited: {', '.join(missing)}."
    return Check(
        "balances_add_up", title, False, message, trace=ev.traces.get(missing[0], []) if missing else [],
        hint="credit the balance in the same transaction as the payment row and the processed row",
    )  # fmt: skip


def _stable_key_check(ev: _Evidence) -> Check:
    title = "the idempotency key sent to the gateway is the same on every delivery of a payment"
    no_key = ev.story_first([pid for pid in ev.ids() if any(k is None for k in ev.keys.get(pid, []))])
    unstable = ev.story_first([pid for pid in ev.ids() if len({k for k in ev.keys.get(pid, []) if k is not None}) > 1])
    if not no_key and not unstable:
        return Check("stable_key", title, True)
    hint = (
        "derive the key from the payment (payment['payment_id']), never from the attempt (uuid4) or from the "
        "message (its stream sequence): a redelivery and a republished copy must send the same key"
    )
    if unstable:
        pid = unstable[0]
        keys = ev.keys[pid]
        message = (
            f"{_n(len(unstable), 'payment')} reached the gateway under more than one key: {pid} was sent "
            f"{len(set(keys))} different keys ({_keys_text(keys)}) over {ev.deliveries_text(pid)}."
        )
    else:
        pid = no_key[0]
        message = (
            f"{len(no_key)} of {PAYMENTS} payments were sent to the gateway without an idempotency key, e.g. {pid}: "
            "the gateway cannot tell a retry of it from a new payment."
        )
        hint = "pass idempotency_key=<the payment's id> to env.charge"
    return Check("stable_key", title, False, message, trace=ev.traces.get(pid, []), hint=hint)


def _acked_check(info: Any, pool: _Pool, ev: _Evidence) -> Check:
    title = "every payment message is acked on the durable 'payments' (nothing stuck)"
    pending, unacked = info.num_pending, info.num_ack_pending
    if pending == 0 and unacked == 0:
        return Check("all_acked", title, True)
    message = (
        f"the durable 'payments' still has {pending} undelivered and {unacked} delivered-but-unacked messages "
        f"({info.num_redelivered} redelivered) at the end of the run."
    )
    died = [w.died for w in pool.workers if w.died]
    if died:
        d = died[0]
        message += f"\nA worker died: {d.get('error')}({d.get('message')}) at {d.get('where')}."
    message += _first_error(ev)
    return Check(
        "all_acked", title, False, message,
        hint="handle_payment must return normally for every delivery, duplicates included: claim the key with "
        "insert ... on conflict (payment_id) do nothing and skip when it changed 0 rows, instead of raising",
    )  # fmt: skip
