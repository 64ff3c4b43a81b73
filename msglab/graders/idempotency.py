"""Lab 03 grader: a payment worker that charges and credits each payment once, however it is delivered.

Workload (seeded): the course's payment gateway (msglab.world.gateway: keys kept 24 h, search that
lags a minute behind, its own store), served from the grader's process and reached over NATS, and
seven worker processes running the learner's `payment_worker` on the durable 'payments'. Every
worker starts held (msglab.grading.scaffold.HeldSpawns); the grader releases them one at a time, so
each planned crash meets the payment the grader gave that worker, whatever the learner's fetch size:

1. five one-shot workers, each handed one fresh payment and SIGKILLed at one point of the
   handler: after the gateway charged, for a payment whose message the grader then removes from
   the stream (its next message is the checkout's copy, after the key window); before the gateway
   call; after the gateway charged (the answer never arrives); right after its first database
   commit; and after the gateway charged, for the payment whose redelivery comes after the
   gateway's key window. ack_wait is 1.1 s, so every redelivery comes more than a second after the
   delivery it replaces (a key made from the clock or the attempt changes in between);
2. two long-running workers take over. One payment is published twice at once (the checkout's
   retry): each worker takes a copy, and the first to reach its first database write for it is
   held there until the other reaches its own, then both go on together (the same place for
   every variant, so only the learner's uniqueness guarantee decides the race); four more
   payments follow;
3. the queue goes idle until a worker's fetch has expired and it asked again (seen on the broker),
   then one late payment is published: a worker already running must handle it (rule 2,
   `survives_idle`);
4. the crashed payments are redelivered. Before the redelivery of the last one reaches the
   gateway, the gateway's test clock moves 25 h forward (a day passes): its key is forgotten.
   Then one payment the shop credited earlier is published again (a copy, a day later), and so is
   the payment whose message was removed: charged a day before, never recorded, and now a new
   message on its first delivery, so a worker that asks the search only on a redelivery (or only
   for a message it saw before) charges it again.

Invariants judged on the gateway's store, the learner's ledger (read from its database file after
the run), the broker and the grader's own records of effect calls, never on printed text: no
payment charged twice; every payment charged and credited; none credited twice; one stable
idempotency key per payment; every message acked (`all_acked`); the late payment handled by a
running worker (`survives_idle`).
Exactly once is the lab's invariant, so no duplicate effect is allowed anywhere, not even after a
kill before an ack (rule 6 allows none here).

The hooks in the learner's process are effect calls the grader answers: `charge` and
`find_charges` (the grader forwards them to the gateway), `db_write` before the first write of each
transaction on env.db (where the race holds a worker) and `db_commit` after each commit that
changed rows (where a worker is killed), and `held` when a worker starts (where it waits to be
released). Which payment a database call concerns is read from what its statements mention, else
from the worker's latest gateway call; that attribution only shapes traces and the race, never a
verdict's evidence (charges come from the gateway's store, credits from the ledger file).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from msglab.grading import rules
from msglab.grading.nemesis import Crash, rng
from msglab.grading.rules import plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, held
from msglab.grading.verdict import Check
from msglab.world import gateway as gw
from msglab.world.gateway import GatewayError, IdempotencyKeyInUse, IdempotencyKeyReused  # noqa: F401 (raised in workers)
from msglab.world.payments import ledger_counts, open_shop

if TYPE_CHECKING:  # the learner's processes import this module too: they need none of the grader's side
    from msglab.grading.harness import Child, Run
    from msglab.grading.observe import BrokerWatch

ACK_WAIT = 1.1  # seconds; production uses 30 s. Over 1 s, so a redelivery's key made from the clock differs
TOPOLOGY = Topology("PAYMENTS", "payments.>", "payments", "payments.received", ACK_WAIT, {"max_ack_pending": 100})
STREAM, DURABLE, SUBJECT = TOPOLOGY.stream, TOPOLOGY.durable, TOPOLOGY.subject
KEY_WINDOW = gw.DEFAULT_WINDOW  # the gateway keeps keys 24 h, a common production figure
SEARCH_LAG = gw.DEFAULT_SEARCH_LAG  # a charge shows up in the gateway's search a minute after it was made
CLOCK_JUMP = 25 * 3600.0  # how far the gateway's test clock moves: past the key window
PAYMENTS = 10
ACCOUNTS = 3
PLAIN = 3  # payments with nothing done to them (one of them is published again a day later)
STEP_WAIT = 3.0  # the longest a one-shot worker gets to reach its planned crash
RACE_WAIT = 3.0  # the longest the first raced worker is held waiting for the second
SETTLE_WAIT = 5.0  # the longest the grader waits for a phase's messages to be handled
IDLE_MIN, IDLE_CAP = 1.0, 8.0  # bounds on how long the grader waits to see a worker fetch again
STUCK_NAKS = 3  # a message nak'ed this many times is judged stuck: it will not settle by waiting
# The learner's permissions (msglab.broker.users): besides fetching from and acking on the durable, a
# worker needs no subject; it may use the lab's own (payments.>) and nothing else. It reaches the gateway
# only through env.charge and env.find_charges (effects the grader answers): the gateway's subjects, test
# clock included, are the course's.
LEARNER_SUBJECTS = ["payments.>"]
LEARNER_DENY_PUBLISH = ["gateway.>"]

_CHARGED = (
    "charge every payment your worker takes through env.charge, one call per payment, while the process keeps running"
)
_COMMITTED = "credit every payment your worker takes in a transaction that commits, while the process keeps running"


def _kill(effect: str, when: str, point: str, counted: str, hint: str) -> Crash:
    """A one-shot worker's crash, with rule 1's words for it (rules.faults_check) should it not fire."""
    return Crash(effect, 1, when, point=point, counted=counted, hint=hint)


# The one-shot workers, in the order they run: what each is planned to meet (its trace's words).
# The first one's message is removed from the stream after its kill, so nothing redelivers it: its
# payment next comes as the checkout's copy, a new message, after the key window. It runs first so
# the other four keep their redeliveries as close to their kills as before.
POINTS: dict[str, tuple[Crash, str]] = {
    "copy_later": (
        _kill("charge", "after", "right after the gateway charged its first payment", "env.charge call", _CHARGED),
        "killed after the gateway charged it, before the answer arrived (its message is removed; a copy comes a "
        "day later)",
    ),
    "before_charge": (
        _kill("charge", "before", "before its first env.charge call", "env.charge call", _CHARGED),
        "killed before the gateway call",
    ),
    "after_charge": (
        _kill("charge", "after", "right after the gateway charged its first payment", "env.charge call", _CHARGED),
        "killed after the gateway charged it, before the answer arrived",
    ),
    "after_commit": (
        _kill("db_commit", "after", "right after its first database commit", "database commit", _COMMITTED),
        "killed right after its first database commit for it",
    ),
    "key_expired": (
        _kill("charge", "after", "right after the gateway charged its first payment", "env.charge call", _CHARGED),
        "killed after the gateway charged it, before the answer arrived (its redelivery comes a day later)",
    ),
}


# --- what runs inside the learner's processes ------------------------------------------------

_WRITES = ("insert", "update", "delete", "replace", "begin")  # a statement that starts writing


def _verb(sql: str) -> str:
    return sql.lstrip().split(None, 1)[0].lower() if sql.strip() else ""


def _texts(sql: str, parameters: Any, many: bool = False) -> list[str]:
    """What a statement mentions (its text, its string parameters), so the grader can tell which payment."""
    rows: Iterable[Any] = list(parameters)[:4] if many else [parameters]
    found = [sql[:300]]
    for row in rows:
        values = row.values() if isinstance(row, dict) else row if isinstance(row, list | tuple) else ()
        found += [v[:80] for v in values if isinstance(v, str)][:8]
    return found


class _ShopCursor(sqlite3.Cursor):
    """Every statement goes through the connection's hooks, whichever way the learner runs it.

    A statement that fails is raised again without the frames below this one, so the traceback a
    verdict quotes ends at the learner's own line (and this one), not in the grader's hooks.
    """

    def execute(self, sql: str, parameters: Any = (), /) -> _ShopCursor:
        db: _ShopDb = self.connection  # type: ignore[assignment]
        was = db._before(sql, _texts(sql, parameters))
        try:
            sqlite3.Cursor.execute(self, sql, parameters)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None
        db._after(sql, was)
        return self

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> _ShopCursor:
        db: _ShopDb = self.connection  # type: ignore[assignment]
        rows = list(seq_of_parameters)
        was = db._before(sql, _texts(sql, rows, many=True))
        try:
            sqlite3.Cursor.executemany(self, sql, rows)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None
        db._after(sql, was)
        return self

    def executescript(self, script: str, /) -> _ShopCursor:
        db: _ShopDb = self.connection  # type: ignore[assignment]
        was = db._before(script, [script[:300]])
        try:
            sqlite3.Cursor.executescript(self, script)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None
        db._after(script, was)
        return self


class _ShopDb(sqlite3.Connection):
    """The learner's sqlite3 connection. Two effect calls the grader answers: `db_write` before the
    first write of each transaction (where the race holds a worker) and `db_commit` after each
    commit that changed rows (where a worker can be killed)."""

    world: Any = None
    _mark = 0  # total_changes at the last commit or rollback
    _mentions: list[str]

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or _ShopCursor)

    def execute(self, sql: str, parameters: Any = (), /) -> Any:
        try:
            return self.cursor().execute(sql, parameters)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None

    def executemany(self, sql: str, parameters: Any, /) -> Any:
        try:
            return self.cursor().executemany(sql, parameters)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None

    def executescript(self, script: str, /) -> Any:
        try:
            return self.cursor().executescript(script)
        except sqlite3.Error as error:
            raise error.with_traceback(None) from None

    def commit(self) -> None:
        super().commit()
        self._ended()

    def rollback(self) -> None:
        super().rollback()
        self._reset()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
        result = super().__exit__(exc_type, exc, tb)
        if exc_type is None:
            self._ended()
        else:
            self._reset()
        return result

    def _before(self, sql: str, texts: list[str]) -> bool:
        """Before a statement: the grader's db_write call if it starts a transaction; returns in_transaction."""
        if _verb(sql) in _WRITES and not self.in_transaction:
            self.world.call("db_write", None, statement=sql.strip()[:200], mentions=texts)
        self._mentions = [*getattr(self, "_mentions", []), *texts][-24:]
        return self.in_transaction

    def _after(self, sql: str, was: bool) -> None:
        if was and not self.in_transaction and _verb(sql) == "rollback":
            self._reset()
        elif not self.in_transaction:
            self._ended()  # a commit, or a statement that committed on its own (autocommit)

    def _ended(self) -> None:
        rows = self.total_changes - self._mark
        mentions = getattr(self, "_mentions", [])
        self._reset()
        if rows > 0:
            self.world.call("db_commit", None, rows=rows, mentions=mentions)

    def _reset(self) -> None:
        self._mark = self.total_changes
        self._mentions = []


def open_shop_db(path: str, world: Any) -> sqlite3.Connection:
    """The shop's database as a worker sees it (msglab.world.payments.open_shop), its calls reported to the grader."""
    db = cast(_ShopDb, open_shop(path, factory=_ShopDb))
    db.world = world
    db._reset()
    return db


def _add_effects(env: Any) -> None:
    """Give env the shop's database and the gateway's two calls, each an effect the grader answers."""
    env.db = open_shop_db(env.db_path, env.world)

    async def charge(payment: dict[str, Any], idempotency_key: Any = None) -> dict[str, Any]:
        key = None if idempotency_key is None else str(idempotency_key)
        detail = {"account": str(payment["account"]), "cents": int(payment["cents"]), "idempotency_key": key}
        return env.world.call("charge", str(payment["payment_id"]), **detail)

    async def find_charges(payment_id: Any) -> list[dict[str, Any]]:
        return env.world.call("find_charges", str(payment_id))

    env.charge = charge
    env.find_charges = find_charges
    env.IdempotencyKeyReused = IdempotencyKeyReused


async def role_payment_worker(env: Any, learner: Any) -> None:
    """One payment worker: waits held until the grader releases it, then runs the learner's loop."""
    _add_effects(env)
    held(env)
    await learner.payment_worker(env)


async def playground(env: Any) -> None:
    """For the lab notebook: the same stream and durable, a gateway of its own, a fresh database.

    env.charge and env.find_charges print what the gateway did; env.gateway reads its store and
    moves its clock (`await env.gateway.advance(env.nc, hours=25)`).
    """
    await TOPOLOGY.provision(env.js, env.names)
    folder = tempfile.mkdtemp(prefix="msglab-try03-")
    atexit.register(shutil.rmtree, folder, True)  # gone when the notebook's kernel exits
    gateway = await gw.attach(
        env.nc, os.path.join(folder, "gateway.sqlite"), prefix=env.subject("gateway"), window=KEY_WINDOW,
        search_lag=SEARCH_LAG,
    )  # fmt: skip
    env.gateway = gateway
    env.db = open_shop(os.path.join(folder, "shop.sqlite"))
    env.IdempotencyKeyReused = IdempotencyKeyReused

    async def charge(payment: dict[str, Any], idempotency_key: Any = None) -> dict[str, Any]:
        key = None if idempotency_key is None else str(idempotency_key)
        reply = await gw.charge(
            env.nc, gateway.subject, str(payment["account"]), int(payment["cents"]),
            reference=str(payment["payment_id"]), idempotency_key=key,
        )  # fmt: skip
        what = "answered with its earlier charge" if reply["replayed"] else "charged"
        print(f"gateway {what} {reply['charge_id']} for {payment['payment_id']} (key {key!r})")
        return reply

    async def find_charges(payment_id: Any) -> list[dict[str, Any]]:
        found = await gateway.search(env.nc, str(payment_id))
        print(f"gateway search for {payment_id}: {[c['charge_id'] for c in found] or 'nothing (yet)'}")
        return found

    env.charge = charge
    env.find_charges = find_charges


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    payments: tuple[dict[str, Any], ...]
    crashed: tuple[tuple[str, str], ...]  # (point, payment id), in the order the one-shot workers run
    race: str
    plain: tuple[str, ...]
    late: str
    day_later: str  # one of plain, published again after the gateway's clock moved

    def payment(self, pid: str) -> dict[str, Any]:
        return next(p for p in self.payments if p["payment_id"] == pid)

    def point_of(self, pid: str) -> str | None:
        return next((point for point, p in self.crashed if p == pid), None)

    @property
    def copy_later(self) -> str:
        """The payment charged by a killed worker whose message is removed: a copy comes after the key window."""
        return dict(self.crashed)["copy_later"]

    @property
    def ids(self) -> list[str]:
        return [p["payment_id"] for p in self.payments]


def draw_plan(seed: int) -> _Plan:
    """The workload and its faults, all from the seed: `--seed N` replays the same plan."""
    r = rng(seed, "payments")
    accounts = [*range(1, ACCOUNTS + 1), *(r.randint(1, ACCOUNTS) for _ in range(PAYMENTS - ACCOUNTS))]
    r.shuffle(accounts)  # every account has at least one payment
    payments = tuple(
        {"payment_id": f"p-{i:02d}", "account": f"acct-{account}", "cents": r.randint(100, 9999)}
        for i, account in enumerate(accounts, start=1)
    )
    ids = [str(p["payment_id"]) for p in payments]
    picks = rng(seed, "roles").sample(ids, len(ids))
    crashed = tuple(zip(POINTS, picks[: len(POINTS)], strict=True))
    race, late, plain = picks[len(POINTS)], picks[len(POINTS) + 1], tuple(picks[len(POINTS) + 2 :])
    assert len(plain) == PLAIN
    day_later = rng(seed, "day_later").choice(plain)
    return _Plan(payments, crashed, race, plain, late, day_later)


# --- the grader's side of the run --------------------------------------------------------------


@dataclass
class _Published:
    seq: int
    payment_id: str
    label: str  # "first", "copy" (published twice at once), "day_later", "resent", "late"
    ts: float


@dataclass
class _Race:
    payment: str = ""
    pair: tuple[int, ...] = ()  # the two long-running workers' pids
    open: bool = False
    arrived: dict[int, float] = field(default_factory=dict)  # pid -> when it reached its first write
    met: asyncio.Event = field(default_factory=asyncio.Event)
    released: float = 0.0
    timed_out: bool = False


@dataclass
class _ChargeCall:
    """One charge request a worker made, as the grader forwarded it to the gateway."""

    ts: float
    pid: int
    payment_id: str
    key: str | None
    outcome: str  # charged, replayed, refused
    charge_id: str = ""


class _Lab:
    """Everything one grading run of lab 03 keeps: the plan, the world's services and what was seen."""

    def __init__(self, run: Run, plan: _Plan, gateway: gw.AttachedGateway, watch: BrokerWatch, db_path: str) -> None:
        self.run = run
        self.plan = plan
        self.gateway = gateway
        self.watch = watch
        # Five one-shot workers (one planned crash each), then two long-running ones, all started before
        # anything is published and released one by one.
        crashes = [crash for crash, _ in POINTS.values()]
        self.spawns = HeldSpawns(
            run, "payment_worker", lambda n: crashes[n : n + 1], len(crashes) + 2, params={"db_path": db_path}
        )
        self.published: list[_Published] = []
        self.removed: set[int] = set()  # stream sequences the grader removed from the stream (nothing delivers them)
        self.current: dict[int, str] = {}  # worker pid -> payment of its latest gateway call
        self.handed: dict[int, str] = {}  # one-shot worker pid -> the payment it was given
        self.race = _Race()
        self.advanced_at: float | None = None
        self.advance_lock = asyncio.Lock()
        self.calls: list[_ChargeCall] = []
        self.steps: dict[str, list[tuple[float, str]]] = defaultdict(list)  # payment id -> (ts, what happened)
        self.drained = False  # the payments before the idle spell were all settled in time
        self.idle_since: float | None = None
        self.quiet = 0.0  # when the last ack before the late payment came: the queue has been idle since
        self.refetch: Any = None  # the pull request that proved a worker fetched again after an idle gap
        self.problems: list[str] = []  # the grader's own trouble (the gateway did not answer): a GraderError

    # -- effects the workers call

    @property
    def oneshots(self) -> list[Child]:
        """The released workers planned to crash, in order."""
        return [c for c in self.spawns.released if c.faults]

    @property
    def steady(self) -> list[Child]:
        """The released long-running workers."""
        return [c for c in self.spawns.released if not c.faults]

    def attach(self) -> None:
        self.run.on("charge", self.on_charge)
        self.run.on("find_charges", self.on_find)
        self.run.on("db_write", self.on_db_write)
        self.run.on("db_commit", self.on_db_commit)
        self.run.workload.only("charge")  # the calls crash points count by payment (a commit names none)
        self.run.workload.held("charge")  # and only about a payment delivered to that worker

    def step(self, pid: str, text: str, ts: float | None = None) -> None:
        self.steps[pid].append((time.time() if ts is None else ts, text))

    async def on_charge(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> Any:
        from msglab.grading.harness import Refuse

        pid = key or ""
        self.current[child.pid] = pid
        await self._gate(pid)
        idem = detail.get("idempotency_key") or None
        shown = "no key" if idem is None else f"key {idem!r}"
        try:
            reply = await gw.charge(
                self.run.nc, self.gateway.subject, str(detail.get("account")), int(detail.get("cents", 0)),
                reference=pid, idempotency_key=idem,
            )  # fmt: skip
        except IdempotencyKeyReused as exc:
            self.calls.append(_ChargeCall(time.time(), child.pid, pid, idem, "refused"))
            self.step(pid, f"worker {child.pid} asked the gateway to charge it ({shown}): refused, the key was "
                           "first used for other parameters")  # fmt: skip
            raise Refuse("IdempotencyKeyReused", str(exc)) from None
        except GatewayError as exc:
            raise Refuse("GatewayError", str(exc)) from None
        except Exception as exc:  # the course's own gateway failed: never the learner's fault
            self.problems.append(f"the gateway did not answer a charge request: {exc!r}")
            raise Refuse("GatewayError", "the course's gateway did not answer (a grader problem)") from None
        outcome = "replayed" if reply.get("replayed") else "charged"
        self.calls.append(_ChargeCall(time.time(), child.pid, pid, idem, outcome, str(reply.get("charge_id"))))
        self.run.record_effect(
            child, "charge", pid, idempotency_key=idem, charge_id=reply.get("charge_id"), outcome=outcome
        )
        what = "answered with its earlier charge" if outcome == "replayed" else "charged"
        self.step(pid, f"worker {child.pid} asked the gateway to charge it ({shown}): {what} {reply.get('charge_id')}")
        return reply

    async def on_find(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> Any:
        from msglab.grading.harness import Refuse

        pid = key or ""
        self.current[child.pid] = pid
        await self._gate(pid)
        try:
            found = await self.gateway.search(self.run.nc, pid)
        except Exception as exc:
            self.problems.append(f"the gateway did not answer a search: {exc!r}")
            raise Refuse("GatewayError", "the course's gateway did not answer (a grader problem)") from None
        ids = ", ".join(c["charge_id"] for c in found) or "nothing"
        self.step(pid, f"worker {child.pid} searched the gateway for charges of it: {ids}")
        return found

    def attribute(self, child: Child, detail: dict[str, Any]) -> str | None:
        """The payment a database statement is about: the one it mentions, else the worker's current one."""
        texts = detail.get("mentions") or []
        for text in texts if isinstance(texts, list) else []:
            for pid in self.plan.ids:
                if isinstance(text, str) and pid in text:
                    return pid
        return self.handed.get(child.pid) or self.current.get(child.pid)

    async def on_db_write(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        race = self.race
        if not race.open or child.pid not in race.pair or child.pid in race.arrived:
            return
        if self.attribute(child, detail) not in (race.payment, None):
            return
        race.arrived[child.pid] = time.time()
        self.step(race.payment, f"worker {child.pid} reached its first database write for it: held there until a "
                                "second worker reaches its own")  # fmt: skip
        if len(race.arrived) >= 2:
            race.met.set()
        else:
            try:
                await asyncio.wait_for(race.met.wait(), RACE_WAIT)
            except TimeoutError:
                race.timed_out = True
                self.step(race.payment, f"no second worker reached a write for it within {RACE_WAIT:.0f} s: "
                                        f"worker {child.pid} let go alone")  # fmt: skip
        if race.open:
            race.open = False
            race.released = time.time()
            if race.met.is_set():
                self.step(race.payment, "both workers let go at once: each goes on with its write")

    async def on_db_commit(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        pid = self.attribute(child, detail)
        rows = int(detail.get("rows", 0) or 0)
        if pid:
            self.step(pid, f"worker {child.pid} committed a transaction ({rows} row{'s' if rows != 1 else ''} written)")

    # -- the key window

    async def _gate(self, pid: str) -> None:
        """The redelivery of the payment whose worker died after the charge reaches the gateway a day later."""
        expired = dict(self.plan.crashed)["key_expired"]
        if pid != expired or self.advanced_at is not None:
            return
        worker = next((c for c in self.oneshots if self.handed.get(c.pid) == expired), None)
        if worker is None or not worker.fired:
            return  # its own first delivery: no crash yet
        await self.advance_when_settled()

    async def advance_when_settled(self) -> None:
        """Once the payments killed inside the key window are settled, move the gateway's clock 25 h forward."""
        async with self.advance_lock:
            if self.advanced_at is not None:
                return
            # The payments crashed inside the window get their redelivery inside it. Nothing else is waited
            # for: the race or the plain payments may go on across the jump (a correct worker does not care).
            inside = {pid for point, pid in self.plan.crashed if point not in ("key_expired", "copy_later")}
            waiting = [p.seq for p in self.published if p.payment_id in inside]
            await self.run.wait_for(lambda: self.settled(waiting), SETTLE_WAIT)
            await self.gateway.advance(self.run.nc, seconds=CLOCK_JUMP)
            self.advanced_at = time.time()

    # -- publishing and waiting

    async def publish(self, pid: str, label: str) -> _Published:
        ack = await self.run.js.publish(self.run.names.subject(SUBJECT), json.dumps(self.plan.payment(pid)).encode())
        sent = _Published(int(ack.seq), pid, label, time.time())
        self.published.append(sent)
        said = {
            "first": "published",
            "copy": "published again at once, as a second message (the checkout retried)",
            "day_later": "published again, as a new message, after the gateway's clock moved (a day later)",
            "resent": "published again a day later, as a new message (the checkout never saw it confirmed)",
            "late": "published after the queue had been idle",
        }[label]
        self.step(pid, f"{said}: stream seq {sent.seq}", sent.ts)
        return sent

    def workers_alive(self) -> bool:
        return any(c.alive for c in self.steady)

    def stuck(self, seq: int) -> bool:
        return sum(a.kind == "nak" for a in self.watch.of(seq)) >= STUCK_NAKS

    def settled(self, seqs: Iterable[int]) -> bool:
        """Every one of these messages is acked (or termed, or stuck), or no worker is left to change that."""
        if self.steady and not self.workers_alive():
            return True
        return all(
            seq in self.removed
            or self.watch.acked(seq)
            or any(a.kind == "term" for a in self.watch.of(seq))
            or self.stuck(seq)
            for seq in seqs
        )

    async def remove(self, sent: _Published) -> None:
        """Take a message out of the stream: nothing delivers it again (as a stream's limits or an operator would)."""
        try:
            await self.run.js.delete_msg(self.run.names.stream(STREAM), sent.seq)
        except Exception as exc:  # the course's broker refused: never the learner's fault
            self.problems.append(f"the grader could not remove stream seq {sent.seq}: {exc!r}")
            return
        self.removed.add(sent.seq)
        self.step(sent.payment_id, f"stream seq {sent.seq} removed from the stream: nothing will deliver it again")


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    plan = draw_plan(run.seed)
    # A planned kill lands only on charges of the run's payments. All of them from the start: a one-shot worker
    # runs before its payment is published, and calls made while no key is registered would count.
    run.workload.add(*plan.ids)
    await TOPOLOGY.provision(run.js, run.names)
    watch = await TOPOLOGY.watch(run)
    # The gateway's store sits where learner processes cannot go; it answers on the grader's connection
    # (one process fewer per verdict), over NATS like any service, on subjects learners may not publish to.
    private = os.path.join(run.tmp, "gateway")
    os.mkdir(private, 0o700)
    gateway = await gw.attach(
        run.nc, os.path.join(private, "gateway.sqlite"), prefix=run.names.subject("gateway"), window=KEY_WINDOW,
        search_lag=SEARCH_LAG,
    )  # fmt: skip
    db_path = os.path.join(run.home, "shop.sqlite")  # the learner's service's own state
    # Made in WAL mode before any worker starts: six processes switching a new file to WAL at once can
    # meet a lock SQLite does not wait for. The workers' user owns it (and its folder, for the -wal file).
    sqlite3.connect(db_path).execute("pragma journal_mode=wal").connection.close()
    run.sandbox.give(Path(db_path))
    lab = _Lab(run, plan, gateway, watch, db_path)
    lab.attach()
    try:
        await _play(lab)
    finally:
        await lab.spawns.cancel()
    await lab.spawns.settle()  # so the platform's rule-3 check sees a worker that ended on its own
    if lab.problems:
        from msglab.errors import GraderError

        raise GraderError(lab.problems[0])

    async def all_acked() -> bool:
        return rules.drained(await TOPOLOGY.info(run)) or not lab.workers_alive()

    # A worker that has just credited a redelivery may still be sending its ack: on a loaded machine
    # the broker can hear it a moment after the ledger shows the credit. Bounded: a stuck one stays.
    await run.wait_for(all_acked, ACK_WAIT + 1.0)
    evidence = _Evidence.collect(lab, db_path, await TOPOLOGY.info(run))
    return [
        _charged_once_check(evidence),
        _none_lost_check(evidence),
        _credited_once_check(evidence),
        _stable_key_check(evidence),
        _acked_check(evidence),
        _idle_check(evidence),
        run.workload_check("charge"),
    ]


async def _play(lab: _Lab) -> None:
    """The workload, phase by phase (see the module's docstring)."""
    run, plan = lab.run, lab.plan
    phase = Phases(run)
    stalled = False

    async def wait(condition: Any, timeout: float) -> bool:
        # A phase that times out with no effect from the learner's code at all means it is stuck
        # (a handler that blocks or spins): the later phases are skipped, so the verdict comes fast.
        nonlocal stalled
        before = len(run.log.events())
        done = await run.wait_for(condition, 0.2 if stalled else timeout)
        stalled = stalled or (not done and len(run.log.events()) == before)
        return done

    # Every worker starts held before anything is published, so the phases below run back to back,
    # well inside ack_wait of the first crash: no redelivery is due yet when the race begins.
    lab.spawns.prepare(lab.spawns.limit)
    await asyncio.gather(*lab.spawns.waiting)
    async with phase("one-shot workers"):  # one at a time: each takes the payment published for it and crashes
        for point, pid in plan.crashed:
            worker = await lab.spawns.release()
            assert worker is not None
            lab.handed[worker.pid] = pid
            sent = await lab.publish(pid, "first")
            await wait(lambda w=worker: not w.alive, STEP_WAIT)
            await lab.spawns.stop(worker)  # if its planned crash did not happen, faults_fired says so
            if point == "copy_later" and worker.fired:
                # Charged, never recorded, and now never redelivered: only the checkout's copy comes back.
                await lab.remove(sent)
    async with phase("the race"):  # the long-running workers: one payment published twice at once
        released = time.time()
        pair = [await lab.spawns.release() for _ in range(2)]
        # Both have started (set up their tables, asked for messages) before the race opens: any write of
        # theirs from here on is for the raced payment, the one thing they are given.
        await wait(lambda: sum(p.ts >= released for p in lab.watch.pulls) >= 2, STEP_WAIT)
        lab.race = _Race(payment=plan.race, pair=tuple(w.pid for w in pair if w is not None), open=True)
        raced = [await lab.publish(plan.race, "first"), await lab.publish(plan.race, "copy")]
        await wait(lambda: not lab.race.open or not lab.workers_alive(), RACE_WAIT + STEP_WAIT)
        lab.race.open = False
    async with phase("plain payments"):
        plain = [await lab.publish(pid, "first") for pid in plan.plain]
        lab.drained = await wait(lambda: lab.settled(p.seq for p in raced + plain), SETTLE_WAIT)
        lab.drained = lab.drained and lab.workers_alive()  # settled because no worker is left: not drained
    async with phase("idle"):  # rule 2: until a worker's fetch expired and it asked again
        # The quiet starts at the last ack: a pull request sent after it that waited out its expires,
        # followed by another pull request, proves a worker survived an empty fetch (an ack in between
        # would mean a message came).
        lab.idle_since = max((a.ts for a in lab.watch.acks if a.kind in ("ack", "term")), default=time.time())

        def refetched() -> bool:
            # Naks do not end the quiet: a message nak'ed in a loop is the learner's stuck message, not traffic.
            done = (a.ts for a in lab.watch.acks if a.kind in ("ack", "term"))
            quiet = lab.quiet = max([lab.idle_since or 0.0, *done])
            lab.refetch = lab.watch.refetched_after_idle(quiet)
            if lab.refetch is not None or not lab.workers_alive():
                return True
            longest = max((p.expires for p in lab.watch.pulls), default=0.0)
            return time.time() - quiet > max(IDLE_MIN, 2 * longest + 1.0)  # no worker fetched again: stop waiting

        await run.wait_for(refetched, 0.2 if stalled else IDLE_CAP)  # a quiet spell has no effects by design
    async with phase("late payment"):  # ... and a payment that comes after it
        late = await lab.publish(plan.late, "late")
        await wait(lambda: lab.settled([late.seq]), SETTLE_WAIT)
    async with phase("a day later"):  # the gateway's clock moves 25 h before the last crashed payment reaches it
        await lab.advance_when_settled()
        await lab.publish(plan.day_later, "day_later")
        await lab.publish(plan.copy_later, "resent")
        await wait(lambda: lab.settled(p.seq for p in lab.published), SETTLE_WAIT + ACK_WAIT)


# --- evidence ----------------------------------------------------------------------------------


@dataclass
class _Evidence:
    """Everything the checks judge: the gateway's store, the learner's ledger, the broker, the grader's records."""

    lab: _Lab
    charges: dict[str, list[gw.Charge]]
    requests: dict[str, list[gw.Request]]  # charge requests per payment, as the gateway logged them
    ledger: Counter[str]
    ledger_error: str
    info: Any
    traces: dict[str, list[str]]

    @classmethod
    def collect(cls, lab: _Lab, db_path: str, info: Any) -> _Evidence:
        charges: dict[str, list[gw.Charge]] = defaultdict(list)
        for charge in lab.gateway.charges():
            charges[charge.reference or ""].append(charge)
        requests: dict[str, list[gw.Request]] = defaultdict(list)
        for request in lab.gateway.requests("charge"):
            requests[request.reference or ""].append(request)
        ledger: Counter[str] = Counter()
        ledger_error = ""
        try:
            # The only grader read of a learner-writable path: a copy of it, read without blocking or following
            # a link (a FIFO or a symlink in its place fails the read, never hangs or redirects the grader).
            from msglab.grading.effects import snapshot_sqlite

            ledger = ledger_counts(snapshot_sqlite(db_path, os.path.join(lab.run.tmp, "gateway")))
        except (sqlite3.Error, OSError) as exc:
            ledger_error = f"{type(exc).__name__}: {exc}"
        steps: dict[str, list[tuple[float, str]]] = {pid: list(s) for pid, s in lab.steps.items()}
        for event in lab.run.log.events("crash"):
            pid = event.key or lab.handed.get(event.pid, "")
            point = next((p for p, q in lab.plan.crashed if q == pid), "")
            said = POINTS[point][1] if point else f"killed at {event.name}"
            steps.setdefault(pid, []).append((event.ts, f"worker {event.pid} {said} (SIGKILL, injected)"))
        by_seq = {p.seq: p for p in lab.published}
        for ack in lab.watch.acks:
            sent = by_seq.get(ack.stream_seq)
            if sent is None or ack.kind == "progress":
                continue
            what = {"ack": "acked", "nak": "nak'ed", "term": "termed"}.get(ack.kind, ack.kind)
            steps.setdefault(sent.payment_id, []).append(
                (ack.ts, f"stream seq {ack.stream_seq} {what} (delivery {ack.delivered})")
            )
        if lab.advanced_at is not None:
            for s in steps.values():
                if s and min(t for t, _ in s) < lab.advanced_at < max(t for t, _ in s):
                    s.append((lab.advanced_at, "the gateway's clock moved 25 h forward (a day passes)"))
        traces = {pid: rules.squash([f"{lab.run.at(ts)} {text}" for ts, text in sorted(s)]) for pid, s in steps.items()}
        return cls(lab, charges, requests, ledger, ledger_error, info, traces)

    @property
    def plan(self) -> _Plan:
        return self.lab.plan

    def story_first(self, pids: Iterable[str], order: tuple[str, ...] = ()) -> list[str]:
        """The payments to quote first: by default the incident's own story (killed after the charge) leads."""
        order = order or ("after_charge", "race", "after_commit", "key_expired", "day_later", "before_charge")

        def rank(pid: str) -> int:
            role = self.plan.point_of(pid) or ("race" if pid == self.plan.race else "")
            role = role or ("day_later" if pid == self.plan.day_later else "")
            return order.index(role) if role in order else len(order)

        return sorted(pids, key=lambda pid: (rank(pid), pid))

    def why_again(self, pid: str) -> str:
        """Why this payment reached a worker more than once, from what the grader did and saw."""
        fired = {self.lab.handed.get(e.pid) for e in self.lab.run.log.events("crash")}
        point = self.plan.point_of(pid)
        if point and pid in fired:
            return {
                "before_charge": "its first worker was killed before the gateway call, so the broker delivered it "
                "again",
                "after_charge": "its first worker was killed right after the gateway charged it, before anything was "
                "recorded, so the broker delivered it again",
                "after_commit": "its first worker was killed right after its first commit, before the ack, so the "
                "broker delivered it again",
                "key_expired": "its first worker was killed right after the gateway charged it, before anything was "
                "recorded, and its redelivery reached the gateway after the gateway's clock had moved 25 h",
                "copy_later": "its first worker was killed right after the gateway charged it, before anything was "
                "recorded; that message was removed from the stream, and a day later (the gateway's clock had moved "
                "25 h) the checkout published the payment again as a new message, delivered for the first time",
            }[point]
        if pid == self.plan.race:
            return "the checkout published it twice at once and two workers held it at the same time"
        if pid == self.plan.day_later:
            return "the checkout published it again a day later (the gateway's clock had moved 25 h)"
        return ""

    def searched_first(self, pid: str) -> bool | None:
        """Whether the worker that charged this payment the second time had asked the search first (None: unknown)."""
        calls = [c for c in self.lab.calls if c.payment_id == pid and c.outcome == "charged"]
        if len(calls) < 2:
            return None
        second = calls[1]
        return any(
            f"worker {second.pid} searched" in text for ts, text in self.lab.steps.get(pid, []) if ts <= second.ts
        )

    def trace(self, pid: str, *more: str) -> list[str]:
        return [*self.traces.get(pid, []), *more]

    def seqs(self, pid: str) -> list[int]:
        return [p.seq for p in self.lab.published if p.payment_id == pid]

    def acked_before(self, pid: str, ts: float) -> float | None:
        """When a message of this payment was first acked before ts (the grader's clock), if it was."""
        times = [a.ts for seq in self.seqs(pid) for a in self.lab.watch.of(seq) if a.kind == "ack" and a.ts < ts]
        return min(times) if times else None

    def deaths(self) -> str:
        """A sentence for messages about what is missing, when long-running workers ended on their own."""
        ended = [c for c in self.lab.steady if c.unplanned or c.protocol_error]
        if not ended:
            return ""
        what = "; ".join(f"worker {c.pid} {c.how_it_ended()}" for c in ended[:2])
        alive = sum(c.alive for c in self.lab.steady)
        who = "Both of your long-running workers" if len(ended) > 1 else "One of your two long-running workers"
        tail = "no worker was left to take it" if not alive else "the other one still ran"
        own = "their own" if len(ended) > 1 else "its own"
        return f"\n{who} ended on {own} ({what}): {tail} (see no_unplanned_deaths)."


def _were(count: int, noun: str) -> str:
    """'1 payment was' / '3 payments were'."""
    return f"{plural(count, noun)} {'was' if count == 1 else 'were'}"


def _keys_text(keys: list[str | None]) -> str:
    distinct = list(dict.fromkeys(keys))
    return ", ".join("none" if k is None else repr(k) for k in distinct[:3]) + (" ..." if len(distinct) > 3 else "")


def _spread(ev: _Evidence, pid: str) -> str:
    """How far apart in time the charge requests of one payment came, measured by the gateway."""
    times = [r.ts for r in ev.requests.get(pid, [])]
    if len(times) < 2 or max(times) - min(times) < 1.0:
        return ""
    return f"; they came {max(times) - min(times):.1f} s apart"


def _charged_once_check(ev: _Evidence) -> Check:
    title = "no payment is charged twice at the gateway, not even after the gateway's key window"
    twice = ev.story_first(pid for pid in ev.plan.ids if len(ev.charges.get(pid, [])) > 1)
    if not twice:
        return Check("charged_once", title, True)
    pid = twice[0]
    charges = ev.charges[pid]
    keys = [r.idempotency_key for r in ev.requests.get(pid, [])]
    why = ev.why_again(pid)
    message = (
        f"{len(twice)} of {PAYMENTS} payments were charged more than once: {pid} was charged {len(charges)} times "
        f"({', '.join(c.charge_id for c in charges)}){'; ' + why if why else ''}."
    )
    gap_h = (charges[-1].created - charges[0].created) / 3600
    if any(k is None for k in keys):
        message += " Its charge requests carried no idempotency key, so the gateway took the retry for a new payment."
        hint = "send every charge with an idempotency key that names the payment, the same on every delivery"
    elif len(set(keys)) > 1:
        message += (
            f" Its charge requests carried {len(set(keys))} different keys ({_keys_text(keys)}){_spread(ev, pid)}"
        )
        message += ": to the gateway each one was a new payment."
        hint = (
            "make the key from the payment itself, never from the delivery attempt, the message or the clock: "
            "a redelivery over a second later and a copy with its own stream sequence must send the same key"
        )
    elif gap_h * 3600 > KEY_WINDOW:
        both = "Both requests" if len(keys) == 2 else f"All {len(keys)} charge requests"
        message += (
            f" {both} carried the key {keys[0]!r}, but the charge {charges[-1].charge_id} came {gap_h:.0f} h after "
            f"the first on the gateway's clock, after its {KEY_WINDOW / 3600:.0f} h key window: the gateway had "
            "forgotten the key."
        )
        credited_at = ev.acked_before(pid, charges[-1].ts)
        if credited_at is not None and ev.ledger.get(pid):
            copy = f"the checkout's copy of {pid}, published a day later" if pid == ev.plan.day_later else pid
            message += (
                f"\nYour worker had already handled {pid}: a message of it was acked at {ev.lab.run.at(credited_at)}, "
                f"before this second charge, and it is in your ledger. Your own records knew it was done, but "
                f"{copy} reached the gateway anyway."
            )
            hint = (
                "look in your own records before the gateway call: a payment you have already credited must never "
                "reach the gateway again, whatever the gateway still remembers"
            )
        elif pid == ev.plan.copy_later and ev.searched_first(pid) is False:
            message += (
                f"\nThe copy was a new message on its first delivery, and your worker charged it without asking the "
                f"gateway's search: nothing in your records showed {pid} credited, yet an earlier message of the same "
                "payment had been charged."
            )
            hint = (
                "a first delivery can follow a charge too: a copy of a payment is a new message, whose delivery count "
                "and stream sequence know nothing of the earlier one. Whenever your records do not show the payment "
                "credited, ask the gateway's search what it already charged for it, not only on a redelivery"
            )
        else:
            hint = (
                "when your records do not show a payment as credited, a delivery before this one may still have "
                "charged it: ask the gateway's search what it already charged for this payment (the search "
                "remembers after the key window) and use that charge instead of charging again"
            )
    else:
        hint = "send the payment's own key with every charge, and look in your records before charging"
    return Check("charged_once", title, False, message, trace=ev.trace(pid), hint=hint)


def _none_lost_check(ev: _Evidence) -> Check:
    title = "every payment is charged at the gateway and credited in your ledger (none lost)"
    if ev.ledger_error:
        return Check(
            "none_lost", title, False, f"the grader could not read your ledger table: {ev.ledger_error}",
            hint="keep the ledger table that setup_db creates (payment_id, account, cents, charge_id): the grader "
            "reads it",
        )  # fmt: skip
    lost = ev.story_first(pid for pid in ev.plan.ids if not ev.charges.get(pid) or not ev.ledger.get(pid))
    if not lost:
        return Check("none_lost", title, True)
    pid = lost[0]
    seqs = ev.seqs(pid)
    acked = [seq for seq in seqs if ev.lab.watch.acked(seq)]
    if not ev.charges.get(pid) and not ev.ledger.get(pid):
        what = "was never charged and never credited"
    elif not ev.ledger.get(pid):
        what = f"was charged at the gateway ({ev.charges[pid][0].charge_id}) but has no row in your ledger"
    else:
        what = "is in your ledger, but the gateway never charged it"
    message = f"{len(lost)} of {PAYMENTS} payments were lost: {pid} {what}."
    hint = "handle every delivery to the end before it is acked: charge (once), then credit"
    first = next((w for w, p in ev.lab.handed.items() if p == pid), None)  # the one-shot worker it was handed to
    committed = [t for t, text in ev.lab.steps.get(pid, []) if f"worker {first} committed" in text]
    if acked and committed and not ev.ledger.get(pid) and any(c.pid == first and c.fired for c in ev.lab.oneshots):
        message += (
            f"\nIts first worker committed a transaction for it and was then killed (injected); a later delivery "
            f"was acked without crediting it (stream seq {acked[0]}). That commit recorded the payment as done "
            "without its credit: the kill fell between two transactions."
        )
        hint = (
            "record that a payment is done in the same transaction as its credit: a crash then leaves both or "
            "neither, and the redelivery redoes whatever was lost"
        )
    elif acked and not ev.ledger.get(pid):
        message += f"\nIts message was acked (stream seq {acked[0]}), so the broker will not deliver it again."
    elif not acked:
        message += f"\nIts message (stream seq {', '.join(map(str, seqs))}) was never acked: see all_acked."
    message += ev.deaths()
    end = "never credited" if not ev.ledger.get(pid) else "never charged"
    return Check("none_lost", title, False, message, trace=ev.trace(pid, end), hint=hint)


def _credited_once_check(ev: _Evidence) -> Check:
    title = "no payment is credited twice in your ledger"
    if ev.ledger_error:
        return Check("credited_once", title, False, f"the grader could not read your ledger table: {ev.ledger_error}",
                     hint="keep the ledger table that setup_db creates")  # fmt: skip
    doubled = ev.story_first(
        (pid for pid in ev.plan.ids if ev.ledger.get(pid, 0) > 1),
        ("after_commit", "day_later", "race", "after_charge", "key_expired", "before_charge"),
    )
    if not doubled:
        return Check("credited_once", title, True)
    pid = doubled[0]
    cents = ev.plan.payment(pid)["cents"]
    message = (
        f"{_were(len(doubled), 'payment')} credited more than once: {pid} ({cents} cents) has {ev.ledger[pid]} rows in "
        "your ledger."
    )
    race = ev.lab.race
    if pid == ev.plan.race and len(race.arrived) >= 2:
        message += (
            "\nThe checkout published it twice and two workers held it at the same moment: each was held at its "
            "first database write until the other reached its own, then both wrote, and both credited it. A look "
            "before the write cannot see what the other worker has not committed yet; only the database can "
            "decide who was first."
        )
        hint = (
            "make the database itself refuse a second record of the same payment (a unique key on it), and credit "
            "only when your record was the one written; or take the write lock before you look"
        )
    elif ev.plan.point_of(pid) == "after_commit":
        message += (
            "\nIts worker was killed right after committing the credit, before its ack; the redelivery credited it "
            "again."
        )
        hint = (
            "before crediting, find out in the same transaction whether this payment was already credited, and skip "
            "it if so: the record and the credit must commit together"
        )
    else:
        why = ev.why_again(pid)
        seqs = ev.seqs(pid)
        message += f" It came as {len(seqs)} message(s) (stream seq {', '.join(map(str, seqs))})"
        message += f"; {why}." if why else "."
        hint = "keep a record of credited payments that the database refuses to hold twice, and skip what it holds"
    return Check("credited_once", title, False, message, trace=ev.trace(pid), hint=hint)


def _stable_key_check(ev: _Evidence) -> Check:
    title = "every charge request for a payment carries the same idempotency key"
    no_key = ev.story_first(pid for pid in ev.plan.ids if any(r.idempotency_key is None for r in ev.requests[pid]))
    unstable = ev.story_first(
        pid for pid in ev.plan.ids if len({r.idempotency_key for r in ev.requests[pid] if r.idempotency_key}) > 1
    )
    if not no_key and not unstable:
        return Check("stable_key", title, True)
    hint = (
        "make the key from the payment itself, never from the attempt (a random value, the delivery count), "
        "the message (its stream sequence) or the clock: a redelivery and a copy must send the same key"
    )
    if unstable:
        pid = unstable[0]
        keys = [r.idempotency_key for r in ev.requests[pid]]
        message = (
            f"{_were(len(unstable), 'payment')} sent to the gateway under more than one key: {pid} was sent "
            f"{len(set(keys))} different keys ({_keys_text(keys)}){_spread(ev, pid)}."
        )
    else:
        pid = no_key[0]
        message = (
            f"{len(no_key)} of {PAYMENTS} payments were sent to the gateway without an idempotency key, e.g. {pid}: "
            "the gateway cannot tell a retry of it from a new payment."
        )
        hint = "send every charge with an idempotency key that names the payment"
    return Check("stable_key", title, False, message, trace=ev.trace(pid), hint=hint)


def _acked_check(ev: _Evidence) -> Check:
    stuck = [p for p in ev.lab.published if ev.lab.stuck(p.seq)]
    if not stuck:
        hint = "handle every delivery to the end, duplicates included, and ack it"
        return rules.drained_check(ev.info, DURABLE, ACK_WAIT, noun="payment", hint=hint)
    p = stuck[0]
    naks = sum(a.kind == "nak" for a in ev.lab.watch.of(p.seq))
    return rules.drained_check(
        ev.info, DURABLE, ACK_WAIT, noun="payment", trace=ev.trace(p.payment_id),
        stuck=[f"{p.payment_id} (stream seq {p.seq}) was nak'ed {naks} times: every delivery of it failed"],
        hint="a duplicate is not an error: when a payment was already credited, skip the work and ack it, instead "
        "of raising and letting it come back forever",
    )  # fmt: skip


IDLE_WORDS = rules.IdleWords(
    title="a payment published after an idle spell is handled by a worker that was already running",
    done="charged and acked",
    hint_ended="a worker runs until it is stopped: an empty fetch means 'nothing yet', so ask again, never return",
    hint_slow="keep fetching from the durable and handle each payment as it comes",
    failures=("GatewayError", "IdempotencyKeyReused", "IdempotencyKeyInUse"),
)


def _idle_check(ev: _Evidence) -> Check:
    """Rule 2 (rules.survives_idle): the late payment is charged and acked by a long-running worker."""
    lab = ev.lab
    late = next(p for p in lab.published if p.label == "late")
    handled = [c.pid for c in lab.calls if c.payment_id == late.payment_id] if lab.watch.acked(late.seq) else []
    # Two long-running workers: judged on the one that handled it, else one still running, else the last.
    current = next((c for c in lab.steady if c.pid in handled), None)
    current = current or next((c for c in lab.steady if c.alive), None) or (lab.steady[-1] if lab.steady else None)
    proof = rules.IdleProof(
        late.payment_id, late.ts, lab.quiet or late.ts, lab.drained, lab.refetch, IDLE_CAP, SETTLE_WAIT
    )
    return rules.survives_idle(lab.run.at, proof, current, handled, ev.trace(late.payment_id), IDLE_WORDS)
