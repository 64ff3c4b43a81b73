"""Lab 07's grader: the order pipeline end to end (labs/07_pipeline).

The learner writes checkout's outbox write (`checkout`), the relay (`relay`) and the carrying of the
correlation id from the order into the event's headers. The rest of the pipeline is the course's, each
service a process of its own (msglab.world.shop_services): payments (charges module 03's gateway once per
stored event, keyed by its stream sequence, so a redelivery is replayed but an event stored twice is
charged twice; an order over the card limit is never charged: dead-lettered and `failed`), email (a
receipt per final status through module 04's email provider, retried by growing naks, dead-lettered when
it can never go out) and the status page (`msglab.world.status_page`, read back from the statuses'
stream after a reconnect). The gateway and the provider answer on the grader's connection (two processes
fewer per verdict), their stores in a 0700 folder of the grader's; no service gets a URL (credentials) on
its command line.

Workload (seeded): payments, email and the page start together; the email provider is down from the first
receipt for EMAIL_OUTAGE s; one of orders 1, 5-9 is over the card limit. Orders go through checkout one at a
time; a checkout process is SIGKILLed before its first write to a second table of one order (between its two
writes), another right after one order's commit, before checkout returns (the next order goes to a fresh
process); once the stream stored the k-th row, the first relay is SIGKILLed on its next write to `positions`
if its saved position lags behind the stream (after the ack, before the save), or else, the stream refusing
publishes, on its next publish (after a save, before the ack); it is kept down until a probe in a stream of
its own with the same duplicate window is forgotten; more orders arrive meanwhile; a second relay takes over.
Once it published everything it is stopped, and past another window a third relay starts and one more order is
placed: a relay that re-sends its saved row or the stream's last one, wherever it keeps its position, stores
it twice. A checkout that does not return (no planned kill hangs one) fails orders_committed and ends the
orders. The first payments process, after charging its 2nd-4th delivery, says so on a core subject and waits,
holding it unacked: the grader SIGKILLs it there and starts a fresh one (the event is delivered again and the
gateway replays the charge). More orders while the stream refuses publishes, and the server restarts once the
relay has tried one; then everything must drain. Writes are told by SQLite itself (an authorizer on the
connection `env.open_store()` gives; no other SQLite connection in the learner's processes, refused by an
audit hook in place before the learner's file is imported, which also refuses new processes and the relay's
file writes; the authorizer refuses any schema change and any write outside the role's tables). Judged on the
grader's own records: the shop's database (read-only; an order the grader never placed is a phantom), what the
streams stored (events, statuses, dead letters), the gateway's charges, the provider's sent mail, and the
page's GET /orders at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msglab.grading import rules
from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import refuse_publishes
from msglab.grading.rules import plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, Trace, gone, held, while_moving
from msglab.grading.verdict import Check
from msglab.world import shop_services
from msglab.world.outbox import CORRELATION_ID, SCHEMA
from msglab.world.payments import open_shop

if TYPE_CHECKING:  # learner processes import this module too: they need none of the grader's side
    from msglab.grading.harness import Child, Run

# The stream stores orders.placed alone: it holds only what the learner published (status events: core NATS).
TOPOLOGY = Topology(
    stream="ORDERS", wildcard="orders.placed", durable="payments", subject="orders.placed", ack_wait=0.5
)
STREAM, DURABLE = TOPOLOGY.stream, TOPOLOGY.durable  # the contract: what the learner's permissions protect
STATUS = "orders.status"  # the payments service's status events, orders.status.<order id>
STATUS_STREAM, EMAIL_DURABLE = "STATUS", "email"  # the statuses, stored: the page reads them back, email takes them
DLQ_STREAM = "DLQ"  # the services' dead letters
PAYMENTS_DLQ, EMAIL_DLQ = "orders.payments.dlq", "orders.email.dlq"
HELD = "services.payments.held"  # where the payments process says it holds a charged delivery (and is killed)
# The grader's own marker, in a stream of its own with the same duplicate window (the learner's stream holds
# only what the learner published): forgotten there, every Msg-Id published before it is forgotten in ORDERS.
PROBE_STREAM, PROBE = "PROBE", "probe.window"
STREAMS = (STREAM, STATUS_STREAM, DLQ_STREAM, PROBE_STREAM)
DURABLES = (DURABLE, EMAIL_DURABLE)  # the course's consumers: learner code may not create or change them
# Only the course's services publish these: statuses, dead letters, receipts, charges, the held payments' word.
LEARNER_DENY_PUBLISH = ["orders.status.>", "orders.payments.>", "orders.email.>", "services.>", "gateway.>", "probe.>"]
CARD_LIMIT = shop_services.CARD_LIMIT  # cents: an order over it ends failed (payments' rule, lesson 07's too)
EMAIL_OUTAGE = 0.3  # seconds the email provider is down from the first receipt (it must be retried)
# Longer than a send may take (2 s): only naks bring a receipt back, so a slow machine spends no delivery of
# its budget on an ack_wait (the email process is never killed here).
EMAIL_ACK_WAIT = 5.0
WINDOW = 0.5  # seconds: the stream's duplicate window (JetStream's default is 2 minutes; scaled down)
RECONNECTS = 100  # the run's server restarts once: every connection retries it (every 0.1 s, ~10 s)
PARAMS: dict[str, Any] = {"db": "shop.sqlite"}  # the shop's database, in the run's home folder
MSG_ID = "Nats-Msg-Id"
ORDERS = (6, 3, 3)  # orders placed before the relay's crash, while it is down, after the server's restart
DEADLINE = 5.0  # seconds any phase may wait for the pipeline to catch up (generous: load never judges)
CALL_TIMEOUT = 5.0  # one checkout takes milliseconds
CHECKOUT_BUDGET = 10.0  # seconds all checkouts may take together (13 orders): a slow one ends the orders early
# The order over the card limit (seeded): one whose checkout is never killed mid-transaction (orders 2-4 may
# be) and placed before the stream refuses publishes, so it is committed and must end failed.
OVER_LIMIT = (1, 5, 6, 7, 8, 9)


# What each of the learner's roles may write (SQLite's authorizer refuses the rest): the shop's tables.
WRITES = {"checkout": ("orders", "outbox"), "relay": ("positions",)}
TABLES = ("orders", "outbox", "positions")
_WRITE_ACTIONS = (sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE)
# The schema is the course's: no table, index, trigger, view (temporary or not) made, changed or dropped, no
# other database attached (a position kept elsewhere than `positions` would hide where the kill must land).
_SCHEMA_ACTIONS = frozenset(
    getattr(sqlite3, name)
    for name in dir(sqlite3)
    if name.startswith(("SQLITE_CREATE_", "SQLITE_DROP_")) or name in ("SQLITE_ALTER_TABLE", "SQLITE_ATTACH")
)


class _Reported(sqlite3.Connection):
    """The shop's database as a learner process opens it. SQLite itself tells which tables a statement
    writes (an authorizer, asked as each statement is prepared; no statement cache, so every execute is):
    each table a statement writes is told to the grader (effect `sql`, with the table) before the statement
    runs, where a planned kill may land; a table the role must not write is refused. For checkout, each
    commit with changes is told too (effect `commit`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["cached_statements"] = 0  # a cached statement is not prepared (nor authorized) again
        super().__init__(*args, **kwargs)
        self.world: Any = None
        self.role = ""
        self.told = 0  # total_changes when the last commit was told
        self.seen: set[str] = set()  # tables the current statement writes, told once each
        self.refused = ""  # why the authorizer refused the current statement

    def set_authorizer(self, *args: Any, **kwargs: Any) -> None:
        raise PermissionError("the shop's database keeps the course's authorizer (it tells the grader your writes)")

    def set_trace_callback(self, *args: Any, **kwargs: Any) -> None:
        raise PermissionError("the shop's database keeps the course's callbacks")

    def _authorize(self, action: int, table: str | None, *_: Any) -> int:
        if action in _SCHEMA_ACTIONS or (action in _WRITE_ACTIONS and str(table).startswith("sqlite_")):
            self.refused = "the shop's schema is the course's: no table, index, trigger or view is made or changed"
            return sqlite3.SQLITE_DENY
        if action not in _WRITE_ACTIONS:
            return sqlite3.SQLITE_OK
        allowed = WRITES.get(self.role, TABLES)
        if table not in allowed:  # any other table (sqlite_master too): the role writes only its own
            self.refused = f"the {self.role} writes only {' and '.join(allowed)}, not {table}"
            return sqlite3.SQLITE_DENY
        if table not in self.seen:
            self.seen.add(table)
            self.world.call("sql", None, table=table)
        return sqlite3.SQLITE_OK

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return _statement(self, super().execute, sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        return _statement(self, super().executemany, sql, *args)

    def executescript(self, sql: str) -> sqlite3.Cursor:
        return _statement(self, super().executescript, sql)

    def cursor(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:  # type: ignore[override]
        return super().cursor(_ReportedCursor)

    def commit(self) -> None:
        super().commit()
        _committed(self)

    def __exit__(self, *exc: Any) -> Any:  # `with db:` commits in C, past commit(): told here
        done = super().__exit__(*exc)
        _committed(self)
        return done


def _committed(db: Any) -> None:
    """After a statement or a commit: tell the grader (effect `commit`) once checkout's transaction with
    changes has committed, so a planned kill can land right after an order's commit, before checkout returns."""
    if db.role != "checkout" or db.in_transaction or db.total_changes <= db.told:
        return
    db.told = db.total_changes
    db.world.call("commit", None)


def _statement(db: Any, run: Any, *args: Any) -> Any:
    """Run one execute on the shop's connection: its tables told afresh, a refusal said in the lab's words, a
    commit it made told."""
    db.seen, db.refused = set(), ""
    try:
        result = run(*args)
    except sqlite3.DatabaseError as exc:
        if db.refused:
            raise sqlite3.DatabaseError(f"not authorized: {db.refused} (lab 07's README)") from exc
        raise
    _committed(db)  # autocommit: the statement committed itself
    return result


class _ReportedCursor(sqlite3.Cursor):
    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        return _statement(self.connection, super().execute, sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        return _statement(self.connection, super().executemany, sql, *args)


def _open_store(path: str, world: Any, role: str) -> sqlite3.Connection:
    """A new connection to the shop's database: in a learner process, the grader's (_Reported)."""
    if world is None:  # a notebook's playground: no grader to tell
        return open_shop(path)
    db = open_shop(path, factory=_Reported)
    assert isinstance(db, _Reported)
    db.world, db.role = world, role
    sqlite3.Connection.set_authorizer(db, db._authorize)
    return db


_GUARDED: list[bool] = []
# A process of the learner's starts no other: a child's writes and publishes would escape the authorizer and the
# grader's kills (a relay in a session of its own outlives the SIGKILL of its process group).
_SPAWNS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "pty.spawn"}
)


def before_learner(role: str) -> None:
    """In a learner process, before the learner's file is imported (runner.amain): an audit hook (which cannot
    be removed) refuses every SQLite connection not opened by env.open_store() with the grader's authorizer,
    and every new process, so no write escapes the authorizer, not even one made at import time."""
    if _GUARDED:
        return
    _GUARDED.append(True)
    store = _open_store.__code__
    with contextlib.suppress(ImportError):  # fork_exec raises no audit event of its own: closed here
        import _posixsubprocess

        def refused(*_: Any) -> Any:
            raise PermissionError("lab 07's processes start no other process")

        _posixsubprocess.fork_exec = refused

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in _SPAWNS or event == "ctypes.dlopen" or (event == "import" and args[0] == "_posixsubprocess"):
            raise PermissionError(f"lab 07's processes start no other process nor load C libraries ({event})")
        # a relay's position in a file would be out of the kills' sight (checkout may write files: no position)
        if role == "relay" and event == "open" and args[0] != os.devnull and _writes(args):
            raise PermissionError(
                f"lab 07's relay writes no file ({args[0]}): the relay keeps its position in `positions`"
            )
        if event != "sqlite3.connect":
            return
        frame = sys._getframe(1)
        while frame is not None:
            # env.open_store() itself, for this process's role (its partial's func, called with no world
            # or another role, would open the database without the role's authorizer)
            if frame.f_code is store and frame.f_locals.get("world") is not None and frame.f_locals["role"] == role:
                return
            frame = frame.f_back  # type: ignore[assignment]
        raise PermissionError("lab 07's processes open the shop's database with env.open_store() only")

    sys.addaudithook(hook)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _writes(args: tuple[Any, ...]) -> bool:
    """Whether an `open` audit event (path, mode, flags) opens a file for writing."""
    mode, flags = (*args, None, None)[1:3]
    return (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
    )


def _env(env: Any, role: str = "") -> None:
    """What every process of the lab is handed besides connections and names: the shop's database."""
    path = env.params.get("db", "shop.sqlite")
    path = path if os.path.isabs(path) else os.path.join(os.environ.get("HOME", "."), path)
    world = getattr(env, "world", None)
    if world is not None:  # a learner process: guarded already (before_learner), unless an older runner ran it
        before_learner(role)
    env.db_path, env.open_store = path, functools.partial(_open_store, path, world, role)


def ops_checkout(env: Any, learner: Any) -> dict[str, Any]:
    """The checkout service: the grader places one order at a time through the learner's `checkout`."""
    _env(env, "checkout")

    async def place(order: dict[str, Any], correlation_id: str) -> None:
        await learner.checkout(env, order, correlation_id)

    return {"place": place}


async def role_relay(env: Any, learner: Any) -> None:
    """One incarnation of the learner's relay: waits held until the grader releases it, then runs until killed."""
    _env(env, "relay")
    held(env)
    await learner.relay(env)


async def playground(env: Any) -> None:
    """For a notebook: the stream (short duplicate window) and the shop's database, in the run's names."""
    await _provision(env.js, env.names)
    folder = tempfile.mkdtemp(prefix="msglab-lab07-")  # a fresh shop, removed by msglab.playground_close
    env.on_close = [functools.partial(shutil.rmtree, folder, ignore_errors=True)]
    env.params["db"] = os.path.join(folder, "shop.sqlite")
    _env(env)
    db = open_shop(env.db_path)
    db.executescript(SCHEMA)
    db.close()


async def _provision(js: Any, names: Any) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType

    stream = names.stream(STREAM)
    await js.add_stream(
        name=stream, subjects=[names.subject(TOPOLOGY.wildcard)], duplicate_window=WINDOW, storage=StorageType.FILE
    )
    config = ConsumerConfig(
        durable_name=names.durable(DURABLE),
        filter_subject=names.subject(TOPOLOGY.subject),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=TOPOLOGY.ack_wait,
    )
    await js.add_consumer(stream, config)


async def _provision_probe(js: Any, names: Any) -> None:
    from nats.js.api import StorageType

    await js.add_stream(
        name=names.stream(PROBE_STREAM),
        subjects=[names.subject(PROBE)],
        duplicate_window=WINDOW,
        storage=StorageType.FILE,
    )


# --- the course's side of the pipeline: payments, email and the page, processes of their own -----------


async def _provision_services(js: Any, names: Any) -> None:
    """The statuses' stream (the page reads it back after a restart; email's durable takes from it) and the DLQs."""
    from nats.js.api import AckPolicy, ConsumerConfig, StorageType

    status = names.stream(STATUS_STREAM)
    await js.add_stream(name=status, subjects=[names.subject(f"{STATUS}.>")], storage=StorageType.FILE)
    await js.add_stream(
        name=names.stream(DLQ_STREAM),
        subjects=[names.subject(PAYMENTS_DLQ), names.subject(EMAIL_DLQ)],
        storage=StorageType.FILE,
    )
    config = ConsumerConfig(
        durable_name=names.durable(EMAIL_DURABLE),
        filter_subject=names.subject(f"{STATUS}.>"),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=EMAIL_ACK_WAIT,
        max_deliver=shop_services.MAX_DELIVER,
    )
    await js.add_consumer(status, config)


@dataclass
class Stored:
    """One event the stream stored on orders.placed, as the grader read it back."""

    ts: float
    seq: int
    msg_id: str
    order_id: str
    correlation_id: str


@dataclass
class Dead:
    """One dead letter the DLQ stream stored: which order, its Correlation-Id, why."""

    subject: str
    order_id: str
    correlation_id: str
    reason: str


@dataclass
class Pipeline:
    """The grader's records (the stream, the gateway's charges, the provider's mail, the page) and its faults."""

    run: Run
    stored: list[Stored] = field(default_factory=list)
    statuses: list[Stored] = field(default_factory=list)  # the status events the STATUS stream stored
    dead: list[Dead] = field(default_factory=list)
    finals: dict[str, str] = field(default_factory=dict)  # the final statuses the grader heard (to pace phases)
    gateway: Any = None  # attached on the grader's connection: its store in the grader's private folder
    provider: Any = None  # the same, for module 04's email provider
    page: Any = None  # the status page's process (shop_services.Service)
    services: list[Any] = field(default_factory=list)  # every service process started
    payments: Any = None  # the payments process running now
    kill_payments_at: int = 0  # the first payments process is SIGKILLed after charging this delivery, before its ack
    payments_killed: rules.Planned | None = None
    held: dict[str, Any] = field(default_factory=dict)  # what the killed payments process said it held
    killed_at: float = 0.0
    restarting: asyncio.Task[Any] | None = None
    problems: list[str] = field(default_factory=list)  # the course's own trouble: a GraderError, not a verdict
    ahead: tuple[int, int] | None = None  # the first relay's saved position and the stream's last row, at its kill

    async def start(self, service: str, **options: Any) -> Any:
        """One service process (started in a thread: its ~0.3 s start does not hold the grader's loop)."""
        started = await asyncio.to_thread(shop_services.start, service, self.run.url, **options)
        self.services.append(started)
        return started

    def payments_options(self, hold: bool) -> dict[str, Any]:
        names = self.run.names
        options: dict[str, Any] = {
            "stream": names.stream(STREAM), "durable": names.durable(DURABLE), "gateway": self.gateway.subject,
            "status": names.subject(STATUS), "dlq": names.subject(PAYMENTS_DLQ), "key": "seq",
            "card_limit": CARD_LIMIT,
        }  # fmt: skip
        if hold:
            options.update(hold_after=self.kill_payments_at, announce=names.subject(HELD))
        return options

    async def on_held(self, msg: Any) -> None:
        """The first payments process charged its planned delivery and holds it unacked: SIGKILL it, start another."""
        try:
            said = json.loads(msg.data)
        except ValueError:
            return
        first = self.payments
        if self.payments_killed is None or self.payments_killed.fired or first is None or said.get("pid") != first.pid:
            return
        first.proc.kill()  # SIGKILL, now: the charged delivery is never acked
        self.killed_at, self.held = time.time(), said
        self.payments_killed.fired = True
        self.restarting = asyncio.ensure_future(self.restart_payments())

    async def restart_payments(self) -> None:
        """The fresh payments process (tried three times: a loaded machine can be slow to start one)."""
        for attempt in range(3):
            try:
                self.payments = await self.start("payments", **self.payments_options(hold=False))
                return
            except RuntimeError as exc:
                if attempt == 2:
                    self.problems.append(f"the course's payments service did not start again ({exc})")

    async def on_status(self, msg: Any) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(msg.data)
            if body["status"] in ("confirmed", "failed"):
                self.finals[str(body["id"])] = str(body["status"])

    async def shown(self) -> dict[str, str] | None:
        """The page's GET /orders now (None if the page process does not answer)."""
        if self.page is None:
            return None
        try:
            return await asyncio.to_thread(self.page.orders, 2.0)
        except (OSError, ValueError):
            return None

    def charged(self) -> list[Any]:
        return self.gateway.charges() if self.gateway is not None else []

    def sent(self) -> list[Any]:
        return self.provider.sent() if self.provider is not None else []

    async def stop(self) -> None:
        if self.restarting is not None:
            with contextlib.suppress(Exception):
                await self.restarting
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in self.services), return_exceptions=True)
        for attached in (self.gateway, self.provider):
            if attached is not None:
                with contextlib.suppress(Exception):
                    await attached.stop()

    async def count(self) -> int:
        """How many events the stream holds on orders.placed now (the server's count)."""
        names = self.run.names
        info = await self.run.js.stream_info(names.stream(STREAM), subjects_filter=names.subject(TOPOLOGY.subject))
        return int((info.state.subjects or {}).get(names.subject(TOPOLOGY.subject), 0))

    async def last_msg_id(self) -> int:
        """The Nats-Msg-Id of the last event the stream holds on orders.placed (0: none, or not a row id)."""
        from nats.js.errors import NotFoundError

        names = self.run.names
        try:
            msg = await self.run.js.get_last_msg(names.stream(STREAM), names.subject(TOPOLOGY.subject))
        except NotFoundError:
            return 0
        value = (msg.headers or {}).get(MSG_ID, "")
        return int(value) if value.isdigit() else 0

    async def read_stream(self) -> None:
        """What the stream stored on orders.placed, read back from the server, in order (one request each)."""
        self.stored = await self._read(STREAM, TOPOLOGY.subject)

    async def read_services(self) -> None:
        """The status events and the dead letters the services' streams stored."""
        self.statuses = await self._read(STATUS_STREAM, f"{STATUS}.>")
        self.dead = []
        for subject in (PAYMENTS_DLQ, EMAIL_DLQ):
            for msg in await self._messages(DLQ_STREAM, subject):
                headers = msg.headers or {}
                order = _order_id(msg.data or b"")
                self.dead.append(Dead(subject, order, headers.get(CORRELATION_ID, ""), headers.get("Dlq-Reason", "")))

    async def _read(self, stream: str, subject: str) -> list[Stored]:
        found = []
        for msg in await self._messages(stream, subject):
            headers = msg.headers or {}
            stamp = msg.time.timestamp() if getattr(msg, "time", None) is not None else 0.0
            order_id, cid = _order_id(msg.data or b""), headers.get(CORRELATION_ID, "")
            found.append(Stored(stamp, int(msg.seq or 0), headers.get(MSG_ID, ""), order_id, cid))
        return found

    async def _messages(self, stream: str, subject: str) -> list[Any]:
        from nats.js.errors import NotFoundError

        names, seq = self.run.names, 1
        found: list[Any] = []
        while True:
            try:
                msg = await self.run.js.get_msg(names.stream(stream), seq, subject=names.subject(subject), next=True)
            except NotFoundError:  # nothing more on the subject
                return found
            found.append(msg)
            seq = int(msg.seq or 0) + 1


def _order_id(data: bytes) -> str:
    try:
        body = json.loads(data)
        return str(body.get("id", "")) if isinstance(body, dict) else ""
    except ValueError:
        return ""


def _tear(order: int) -> rules.Planned:
    return rules.Planned(
        f"kill the checkout between the two writes of order o-{order:03d} (before its first write to a second "
        "table of the shop's database)",
        "write each order and its outbox row through env.open_store(): the order to orders, the row to outbox",
    )


def _commit_crash(order: int, commits: int) -> Crash:
    """Kill the checkout right after the commit of order #order, before checkout returns: whatever checkout
    would do next (publish the event itself) never happens, so only the relay can carry that order."""
    return Crash(
        "commit",
        commits + 1,
        "before",
        point=f"right after the commit of order o-{order:03d}, before checkout returned",
        counted="commit",
        hint="commit each order with its outbox row through env.open_store() (one commit per order)",
    )


async def grade(run: Run) -> list[Check]:
    """Run the pipeline through the kills, the relay's long outage and a server restart; judge its records."""
    await _provision(run.js, run.names)
    await _provision_probe(run.js, run.names)
    path = os.path.join(run.home, PARAMS["db"])
    with contextlib.closing(open_shop(path)) as store:
        store.executescript(SCHEMA)
    run.sandbox.give(Path(path))  # the learner's processes write it
    params = {"db": path}
    pipe = Pipeline(run)
    from msglab.world import email_provider as ep
    from msglab.world import gateway

    # The gateway and the email provider answer on the grader's connection (two processes fewer per verdict),
    # over NATS like any service, their stores in a folder of the grader's only (0700), no credentials on any
    # command line; payments, email and the page are processes of their own, started together.
    private = os.path.join(run.tmp, "services")
    os.mkdir(private, 0o700)
    pipe.gateway = await gateway.attach(
        run.nc, os.path.join(private, "gateway.sqlite"), prefix=run.names.subject("gateway")
    )
    pipe.provider = await ep.attach(
        run.nc, os.path.join(private, "provider.sqlite"), prefix=run.names.subject("provider")
    )
    pipe.provider.behaviour.control("template", name=shop_services.TEMPLATES["failed"], known=True)
    pipe.provider.behaviour.control("outage", seconds=EMAIL_OUTAGE, from_next_request=True)
    await _provision_services(run.js, run.names)
    pipe.kill_payments_at = rng(run.seed, "payments kill").randint(2, 4)
    pipe.payments_killed = rules.Planned(
        f"SIGKILL the payments process after its charge of delivery #{pipe.kill_payments_at} (or the first it "
        "charges after it), before its ack",
        "the relay must publish every committed order",
    )
    run.planned.append(pipe.payments_killed)
    held_sub = await run.nc.subscribe(run.names.subject(HELD), cb=pipe.on_held)
    status_sub = await run.nc.subscribe(run.names.subject(f"{STATUS}.>"), cb=pipe.on_status)
    names = run.names
    pipe.page, pipe.payments, _ = await asyncio.gather(
        pipe.start("status", subject=names.subject(f"{STATUS}.>"), stream=names.stream(STATUS_STREAM)),
        pipe.start("payments", **pipe.payments_options(hold=True)),
        pipe.start(
            "email", stream=names.stream(STATUS_STREAM), durable=names.durable(EMAIL_DURABLE),
            provider=pipe.provider.subject, dlq=names.subject(EMAIL_DLQ),
        ),
    )  # fmt: skip
    relay_at = rng(run.seed, "relay kill").randint(2, 4)
    relay_kill = rules.Planned(
        f"kill your first relay once the stream stored its row #{relay_at}: on its next write to the shop's "
        "database if its saved position lags behind the stream (after the ack, before the save), or else right "
        "after that write, on its next publish (after the save, before the stream stored the row)",
        "keep the relay's position in the shop's database (env.open_store()), saved after each ack",
    )
    run.planned.append(relay_kill)
    relays = HeldSpawns(run, "relay", lambda n: [], limit=3, params=params)
    first: list[Child] = []
    # A relay that saves before it publishes opens its gap after the save: armed, the stream refuses publishes
    # and the relay is killed on its next publish (or write), with a position saved past what the stream holds.
    armed: list[Any] = []  # the refusal in force while armed

    async def kill_relay(child: Child, call: int, when: str) -> None:
        relay_kill.fired = True
        run.log.record("crash", "sql", None, pid=child.pid, role=child.role, call=call, when=when)
        await child.kill("nemesis")
        if armed:
            pipe.ahead = (orders.read().position, await pipe.last_msg_id())
        await _end_refusal(armed)

    async def on_sql(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        if child.role == "checkout":
            await orders.on_write(child, str(detail.get("table", "")), call)
            return
        if child.role != "relay" or relay_kill.fired or not first or child is not first[0]:
            return
        if armed:  # saved, and writes again before any publish: killed here
            await kill_relay(child, call, "before")
            return
        if await pipe.count() < relay_at:
            return
        if orders.read().position < await pipe.last_msg_id():  # the stream acked a row not yet saved
            await kill_relay(child, call, "before")
            return
        refusal = refuse_publishes(run.js, run.names.stream(STREAM))
        await refusal.__aenter__()
        armed.append(refusal)

    attempts: list[float] = []

    async def on_publish(msg: Any) -> None:  # any publish on orders.placed the server saw, stored or refused
        attempts.append(time.time())
        if armed and not relay_kill.fired and first and first[0].alive:
            await kill_relay(first[0], 0, "after")

    run.on("sql", on_sql)
    watch = await run.nc.subscribe(run.names.subject(TOPOLOGY.subject), cb=on_publish)
    phase, orders = Phases(run), Orders(run, params)
    relays.prepare(2)
    down, restarted = 0.0, 0.0
    shown: dict[str, str] | None = None
    try:
        async with phase("orders, a checkout killed"):
            released = await relays.release()
            assert released is not None
            first.append(released)
            for _ in range(ORDERS[0]):
                await orders.place()
            can_fire = _can_fire(orders, relay_at)
            await run.wait_for(lambda: _either(relay_kill.fired or gone(first[0]), can_fire()), DEADLINE)
            if armed and not relay_kill.fired and first[0].alive:  # saved, and nothing more to publish
                await kill_relay(first[0], 0, "after")
            if not relay_kill.fired:
                stored = await pipe.count()
                ended = "returned" if first[0].returned else "raised" if first[0].died else ""
                relay_kill.seen = (
                    f"your first relay {ended} on its own after the stream stored {plural(stored, 'event')}"
                    if ended else
                    f"the stream stored {plural(stored, 'event')} and your relay made no database write after"
                    f" row #{relay_at}" if stored >= relay_at else
                    f"the stream stored only {plural(stored, 'event')} of {orders.committed_count()} "
                    "committed orders"
                )  # fmt: skip
            await relays.stop(first[0])
            down = time.time()
        async with phase("relay down past the duplicate window"):
            await _past_window(run, max(attempts, default=0.0))
            for _ in range(ORDERS[1]):
                await orders.place()
            second = await relays.release()
            assert second is not None
            relays.prepare(1)
            await run.wait_for(lambda: _either(gone(second), _published(pipe, orders)), DEADLINE)
        # Where a relay keeps its position, and when it saves it, the grader cannot see: its behaviour it can.
        # Stopped once idle, started again past the window, a relay must publish the next order alone: one
        # that re-sends its saved row or the stream's last (the row it saved before its publish) stores it twice.
        async with phase("relay restarted past the duplicate window"):
            current = second
            if not gone(second):
                await relays.stop(second)
                await _past_window(run, max(attempts, default=0.0))
                third = await relays.release()
                current = third if third is not None else second
            await orders.place()
            await run.wait_for(lambda: _either(gone(current), _published(pipe, orders)), DEADLINE)
        # The restart lands while the relay is publishing: the stream refuses publishes, rows wait in the
        # outbox, and once the relay has tried one of them the server goes away and comes back.
        async with phase("server restart"), refuse_publishes(run.js, run.names.stream(STREAM)):
            mark, before = len(attempts), set(orders.placed)
            for _ in range(ORDERS[2]):
                await orders.place(CALL_TIMEOUT / 2, refused=True)  # one waiting on the stream: not waited out
                if orders.placed[max(orders.placed)][2].hung:  # a checkout waiting on the stream: no more orders
                    break
            if _publishable(orders.read()) - before:  # rows wait (the stream refuses them): the relay tries one
                await run.wait_for(lambda: len(attempts) > mark or gone(current), DEADLINE)
            restarted = await run.restart_broker()
        async with phase("drain"):
            # DRAIN_FIRST, and on while payments keeps charging or email keeps sending: a loaded machine
            # after the restart is slow, not wrong (rule 8), within the run's budget.
            await while_moving(
                run, lambda: _either(gone(current), _settled(pipe, orders)), lambda: _moved(pipe), DRAIN_FIRST,
                stall=STALL, deadline=time.monotonic() + DRAIN_CAP,
            )  # fmt: skip
            await run.wait_for(lambda: pipe.payments_killed is not None and pipe.payments_killed.fired, 0.1)
        shown = await pipe.shown()  # what the page ends showing: read before any service stops
    except _Stalled:  # judged on what the grader has: checkout never answered a customer
        if not relay_kill.fired:
            relay_kill.seen = f"the grader placed no more orders once checkout of {orders.stalled} did not return"
    finally:
        await watch.unsubscribe()
        await held_sub.unsubscribe()
        await status_sub.unsubscribe()
        await _end_refusal(armed)
        await relays.cancel()
        charges, sent = pipe.charged(), pipe.sent()
        await pipe.stop()
    await relays.settle()
    if pipe.problems:
        from msglab.errors import GraderError

        raise GraderError(pipe.problems[0])
    if not pipe.payments_killed.fired and pipe.payments_killed.seen == "":
        info = await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(DURABLE))
        pipe.payments_killed.seen = (
            f"the stream delivered only {plural(int(info.delivered.consumer_seq), 'event')} to payments"
        )
    await pipe.read_stream()
    await pipe.read_services()
    db = orders.read()
    trace = functools.partial(_trace, run, pipe, orders, down, restarted, charges)
    phantom = _phantom_check(pipe, db, orders, trace)  # meaningful with no order committed too
    downstream = [
        _lost_check(pipe, db, orders, trace),
        _published_once_check(pipe.stored, db, down, trace),
        _processed_once_check(charges, db, orders, trace),
        _correlation_check(pipe, orders, db, trace),
        _status_check(pipe, shown, db, orders, trace),
        _receipts_check(pipe, sent, shown, db, orders, trace),
    ]
    if orders.stalled:  # the run stopped early: what follows a checkout was never all exercised
        why = f"checkout of {orders.stalled} did not return, so the grader placed no more orders"
        downstream = [_untested(c, why) for c in downstream]
    elif not db.orders:  # nothing committed: a pass here would claim what no evidence shows (rule 7)
        downstream = [_untested(c) for c in downstream]
    return [_committed_check(orders, db, trace), _one_transaction_check(db, trace), phantom, *downstream]


async def _end_refusal(armed: list[Any]) -> None:
    """Let the stream accept publishes again, if a refusal is in force (once, whoever ends it first)."""
    while armed:
        await armed.pop().__aexit__(None, None, None)


def _untested(check: Check, why: str = "") -> Check:
    return Check(
        check.name,
        check.title,
        False,
        f"untested: {why}." if why else
        "untested: no order was committed, so there was nothing to commit together, nor anything to reach the "
        "stream, payments, email or the page.",
        hint="make checkout return once the order and its outbox row are committed" if why else
        "make checkout commit each order with its outbox row first",
    )  # fmt: skip


PURGE_SLACK = 0.2  # seconds between ORDERS' last publish and the probe's (see _past_window)


async def _past_window(run: Run, last_publish: float) -> None:
    """Wait until a stream with the same duplicate window has forgotten a Msg-Id stored now: the window is
    over in ORDERS for every Msg-Id published before (tests/test_grader_07.py checks that on the server).

    Each stream forgets on a timer of its own that fires no sooner than 50 ms after its last run
    (nats-server's purgeMsgIds): a probe stored as ORDERS' last id was would be forgotten by PROBE's timer
    while ORDERS' still held it (a from-lesson relay passed once so), hence the probe is stored PURGE_SLACK
    after ORDERS' last publish (a timer's wait, not a condition's: the server does not show its id map).
    """
    await asyncio.sleep(max(0.0, last_publish + PURGE_SLACK - time.time()))
    probe, marker = run.names.subject(PROBE), f"probe-{time.time()}"  # its own stream (_provision_probe)
    await run.js.publish(probe, b"", headers={MSG_ID: marker})

    async def forgotten() -> bool:
        ack = await run.js.publish(probe, b"", headers={MSG_ID: marker})
        return not ack.duplicate

    await run.wait_for(forgotten, 4 * WINDOW + DEADLINE)


class _Stalled(Exception):
    """A checkout did not return: the grader places no more orders and judges what it has."""


@dataclass
class Orders:
    """The orders the grader places through the learner's checkout, one process at a time."""

    run: Run
    params: dict[str, Any]
    placed: dict[str, tuple[float, str, Any]] = field(default_factory=dict)  # id -> (ts, correlation id, reply)
    killed: list[str] = field(default_factory=list)
    torn: str = ""  # the order whose checkout was killed between its two writes
    unsent: str = ""  # the order whose checkout was killed right after its commit, before returning
    checkout: Child | None = None
    tearing: rules.Planned | None = None  # the kill between the two tables' writes of the order being placed
    tables: list[str] = field(default_factory=list)  # the tables the order being placed wrote so far
    cents: dict[str, int] = field(default_factory=dict)  # order id -> its amount
    stalled: str = ""  # the order whose checkout did not return (no planned kill hangs one): no more orders
    spent: float = 0.0  # seconds the checkouts took so far (CHECKOUT_BUDGET)

    async def on_write(self, child: Child, table: str, call: int) -> None:
        """A checkout's write to `table`: the planned kill lands before its first write to a second table."""
        plan = self.tearing
        if plan is None or plan.fired or child is not self.checkout:
            return
        if self.tables and table not in self.tables:
            plan.fired = True
            self.run.log.record("crash", "sql", None, pid=child.pid, role=child.role, call=call, when="before")
            await child.kill("nemesis")
        elif table not in self.tables:
            self.tables.append(table)

    async def place(self, timeout: float = CALL_TIMEOUT, refused: bool = False) -> None:
        """Place the next order; `refused`: the stream refuses publishes now (a checkout waiting on it is cut
        short, dual_write's fault, not a hang). Raises _Stalled once a checkout did not return otherwise."""
        if self.checkout is None or not self.checkout.alive:
            self.checkout = await self.run.spawn("checkout", params=self.params)
        n = len(self.placed) + 1
        torn = n == rng(self.run.seed, "checkout kill").randint(2, 4)
        unsent = n == rng(self.run.seed, "checkout kill after commit").randint(5, 6)
        if torn:  # planned as this order starts (rule 1 sees it); aimed at a table, not at a write's number
            self.tearing, self.tables = _tear(n), []
            self.run.planned.append(self.tearing)
        if unsent:
            self.checkout.faults.append(_commit_crash(n, self.checkout.calls["commit"]))
        r = rng(self.run.seed, f"order {n}")
        over = n == rng(self.run.seed, "over the card limit").choice(OVER_LIMIT)
        order: dict[str, Any] = {
            "id": f"o-{n:03d}",
            "customer": f"c-{r.randint(1, 9)}",
            "cents": CARD_LIMIT + 100 * r.randint(1, 50) if over else 100 * r.randint(5, 90),
        }
        self.cents[str(order["id"])] = int(order["cents"])
        cid = f"trace-{r.getrandbits(48):012x}"
        timeout = max(0.5, min(timeout, CHECKOUT_BUDGET - self.spent))  # a slow checkout keeps no grader waiting
        reply = await self.checkout.call("place", timeout, order=order, correlation_id=cid)
        self.spent += reply.elapsed
        self.placed[str(order["id"])] = (time.time(), cid, reply)
        if self.tearing is not None and not self.tearing.fired:
            wrote = " and ".join(self.tables) or "no table"
            self.tearing.seen = f"checkout of {order['id']} wrote to {wrote} through env.open_store()"
        self.tearing = None
        if reply.hung and not refused:
            self.stalled = str(order["id"])
            raise _Stalled
        if reply.gone or reply.hung:
            self.killed.append(str(order["id"]))
            self.torn = str(order["id"]) if torn else self.torn
            self.unsent = str(order["id"]) if unsent else self.unsent

    def expected(self, order_id: str) -> str:
        """How the order must end, by payments' rule: failed over the card limit, else confirmed."""
        return "failed" if self.cents.get(order_id, 0) > CARD_LIMIT else "confirmed"

    def correlation(self, order_id: str) -> str:
        return self.placed[order_id][1] if order_id in self.placed else ""

    def read(self) -> Shop:
        return read_shop(self.params["db"], os.path.join(self.run.tmp, "shop-copy"))

    def committed_count(self) -> int:
        return len(self.read().orders)


@dataclass
class Shop:
    """The shop's database as the grader read it (read-only): committed orders and outbox rows."""

    orders: set[str]
    outbox: dict[int, str]  # outbox id -> order id
    outbox_headers: dict[int, dict[str, str]]
    error: str = ""
    position: int = 0  # the highest position a relay saved in `positions`


def read_shop(path: str, folder: str) -> Shop:
    """The orders and the outbox rows the shop's database holds now ('error' when it cannot be read).

    Read from a copy in the grader's `folder` (effects.snapshot_sqlite): a file in the learner's folder may
    be anything, and a process killed inside a transaction leaves a WAL that only a writer may recover.
    """
    from msglab.grading.effects import LearnerFileError, snapshot_sqlite

    try:
        os.makedirs(folder, exist_ok=True)
        for stale in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, os.path.basename(path)) + stale)
        db = sqlite3.connect(snapshot_sqlite(path, folder), timeout=1)
        try:
            orders = {str(r[0]) for r in db.execute("select id from orders")}
            rows = list(db.execute("select id, order_id, headers from outbox"))
            saved = db.execute("select max(outbox_id) from positions").fetchone()
        finally:
            db.close()
    except (sqlite3.Error, LearnerFileError, OSError) as exc:
        return Shop(set(), {}, {}, f"the shop's database could not be read ({exc})")
    headers: dict[int, dict[str, str]] = {}
    for i, _, h in rows:
        try:
            headers[int(i)] = dict(json.loads(h))
        except (ValueError, TypeError):
            headers[int(i)] = {}
    position = int(saved[0]) if saved and isinstance(saved[0], int) else 0
    return Shop(orders, {int(i): str(o) for i, o, _ in rows}, headers, position=position)


async def _either(now: bool, later: Any) -> bool:
    """`now`, or else what the coroutine `later` says (a coroutine: wait_for asks it at its slower pace)."""
    if now:
        later.close()
        return True
    return bool(await later)


def _can_fire(orders: Orders, relay_at: int) -> Any:
    async def cannot() -> bool:  # too few committed orders for the stream to store row #relay_at
        return orders.committed_count() < relay_at

    return cannot


def _publishable(shop: Shop) -> set[str]:
    """The committed orders a relay can publish (those with an outbox row): what the phases wait for."""
    return shop.orders & set(shop.outbox.values())


async def _wanted(pipe: Pipeline, shop: Shop) -> set[str]:
    """The committed orders the phases wait to see decided: those with an outbox row, less the rows a relay
    passed over (below the stream's last row and not in the stream: a relay publishes in order, it will not
    come back for them), so a run that lost a row is not kept waiting for it."""
    wanted = _publishable(shop)
    missing = wanted - set(pipe.finals)
    if not missing:
        return wanted
    last = await pipe.last_msg_id()
    passed = {o for i, o in shop.outbox.items() if i < last and o in missing}
    if not passed:
        return wanted
    await pipe.read_stream()
    return wanted - (passed - {s.order_id for s in pipe.stored})


async def _published(pipe: Pipeline, orders: Orders) -> bool:
    return await _wanted(pipe, orders.read()) <= set(pipe.finals)


STALL = 2.0  # the drain waits on past DRAIN_FIRST while something moved within this many seconds ...
# A relay publish lost in the restart waits out nats-py's PubAck timeout (5 s) before its retry, and nothing
# moves meanwhile (seen under load: the restart phase's orders stored only ~5 s into the drain): past it.
DRAIN_FIRST = 5.0 + STALL
DRAIN_CAP = 15.0  # ... up to this in all


def _moved(pipe: Pipeline) -> tuple[int, int, int]:
    """What changes while the pipeline drains: the charges, the provider's requests, the statuses heard."""
    requests = len(pipe.provider.requests()) if pipe.provider is not None else 0
    return len(pipe.charged()), requests, len(pipe.finals)


async def _settled(pipe: Pipeline, orders: Orders) -> bool:
    """Every wanted order shown final on the page, as the grader's rule says, with its receipt sent."""
    wanted = await _wanted(pipe, orders.read())
    if not wanted <= {str(e.order_id) for e in pipe.sent()}:
        return False
    shown = await pipe.shown() or {}
    return all(shown.get(o) == orders.expected(o) for o in wanted)


def _trace(
    run: Run, pipe: Pipeline, orders: Orders, down: float, restarted: float, charges: list[Any], order_id: str
) -> list[str]:
    steps = Trace(run)
    if order_id in orders.placed:
        ts, cid, reply = orders.placed[order_id]
        steps.add(ts, f"checkout of {order_id} (Correlation-Id {cid}) {reply.describe()}")
    for e in run.log.events("crash"):
        steps.add(e.ts, f"{e.role} process {e.pid} SIGKILLed by the grader {_where(e)}")
    for s in pipe.stored:
        if s.order_id == order_id:
            steps.add(s.ts, f"stream stored it as #{s.seq} (Nats-Msg-Id {s.msg_id or 'none'})")
    for c in charges:
        if c.reference == order_id:
            steps.add(c.ts, f"payments charged it (idempotency key {c.idempotency_key})")
    if pipe.killed_at and pipe.held.get("order") == order_id:
        steps.add(pipe.killed_at, f"payments process {pipe.held.get('pid')} SIGKILLed after its charge, before its ack")
    for s in pipe.statuses:
        if s.order_id == order_id:
            steps.add(s.ts, f"payments said {s.msg_id.rsplit('-', 1)[-1] or 'a status'}")
    if down:
        steps.add(down, "first relay gone; the grader waits past the duplicate window")
    if restarted:
        steps.add(restarted, "the server restarted")
    return steps.lines()


def _where(crash: Any) -> str:
    """Where a kill landed, in the lab's words."""
    if crash.name == "commit":
        return "right after its commit"
    if crash.role == "relay":
        return "on its next publish, after a save" if crash.detail.get("when") == "after" else "before a database write"
    return "before a database write"


def _committed_check(orders: Orders, shop: Shop, trace: Any) -> Check:
    title = "an order checkout accepted is committed, with its outbox row"
    if shop.error:
        return Check("orders_committed", title, False, shop.error + ".", hint="open the shop with env.open_store()")
    missing = [o for o, (_, _, r) in orders.placed.items() if r.ok and o not in shop.orders]
    # A checkout the grader killed is excused; one that hung is not, unless the stream refused publishes then
    failed = [
        (o, r) for o, (_, _, r) in orders.placed.items()
        if not r.ok and not (r.gone or (r.hung and o != orders.stalled))
    ]  # fmt: skip
    if failed:
        o, r = failed[0]
        cut = r.hung and r.elapsed < CALL_TIMEOUT - 0.1  # stopped early: the checkouts' time was spent
        budget = f", after the checkouts took {CHECKOUT_BUDGET:.0f} s in all" if cut else ""
        return Check(
            "orders_committed", title, False, f"checkout of {o} {r.describe()}{budget}.", trace=trace(o),
            hint="checkout must place the order and return",
        )  # fmt: skip
    if not missing:
        return Check("orders_committed", title, True)
    return Check(
        "orders_committed",
        title,
        False,
        f"checkout returned for {plural(len(missing), 'order')} that the shop's database does not hold: "
        f"{', '.join(missing[:5])}.",
        trace=trace(missing[0]),
        hint="write the order and its outbox row, and commit, before checkout returns",
    )


def _one_transaction_check(shop: Shop, trace: Any) -> Check:
    title = "an order and its outbox row commit together (one transaction)"
    with_row = set(shop.outbox.values())
    alone = sorted(shop.orders - with_row)
    rowless = sorted(with_row - shop.orders)
    if not alone and not rowless:
        ok = Check("one_transaction", title, True)
        return ok if shop.orders else _untested(ok)  # nothing committed: nothing shown to commit together
    if alone:
        message = (
            f"{plural(len(alone), 'order')} committed without an outbox row ({', '.join(alone[:3])}): "
            "a checkout killed between its two writes left the order and no event for it."
        )
    else:
        message = (
            f"{plural(len(rowless), 'outbox row')} for an order that was never committed ({', '.join(rowless[:3])}):"
            " a checkout killed between its two writes left an event for an order that does not exist."
        )
    return Check(
        "one_transaction", title, False, message, trace=trace((alone or rowless)[0]),
        hint="write the order and its outbox row in one transaction: both commit, or neither",
    )  # fmt: skip


HINT_LOST = "publish every outbox row after the relay's saved position, and keep the relay going through errors"


def _lost_check(pipe: Pipeline, shop: Shop, orders: Orders, trace: Any) -> Check:
    title = "every committed order's event reaches the stream, whatever crashed (the relay resumes without loss)"
    stored = {s.order_id for s in pipe.stored}
    lost = sorted(o for o in shop.orders if o not in stored)
    if not lost:
        return Check("no_lost_events", title, True)
    message = f"{plural(len(lost), 'committed order')} never reached the stream: {', '.join(lost[:5])}."
    hint = HINT_LOST
    rowless = [o for o in lost if o not in set(shop.outbox.values())]
    first = (rowless or lost)[0]
    if rowless:  # checkout's fault: no row, nothing for any relay to publish
        message += f" {', '.join(rowless[:3])} committed without an outbox row, so no relay could publish it."
        hint = "checkout must commit the order and its outbox row together (one transaction)"
    else:  # a row the relay skipped, an order only the relay could carry: both said where both apply
        unsent = orders.unsent in lost and any(o > orders.unsent and o not in lost for o in shop.orders)
        skipped = bool(pipe.ahead and pipe.ahead[0] > pipe.ahead[1] and shop.outbox.get(pipe.ahead[0]) in lost)
        if unsent:
            first = orders.unsent
            message += (
                f" The grader killed checkout right after it committed {orders.unsent}: only the relay, reading the"
                " outbox, can publish it."
            )
            hint = "checkout only commits the order and its outbox row; the relay publishes every outbox row"
        if skipped and pipe.ahead:
            message += (
                f" Your first relay was killed with position {pipe.ahead[0]} saved while the stream's last row was"
                f" #{pipe.ahead[1]}: it saved a row before the stream stored it, and the next relay skipped that row."
            )
            hint = "save the relay's position only after the stream acknowledged the row" + (
                "; the relay publishes every outbox row, checkout none" if unsent else ""
            )
    ended = next((r for r in pipe.run.children if r.role == "relay" and (r.returned or r.died)), None)
    if not rowless and hint == HINT_LOST and ended is not None:
        message += f" Your relay process {ended.pid} {'returned' if ended.returned else 'raised'} on its own."
        hint = "keep the relay running as long as its process lives: an empty outbox or an error is no reason to stop"
    return Check(
        "no_lost_events", title, False, message, trace=[*trace(first), "never published"], hint=hint
    )  # fmt: skip


def _phantom_check(pipe: Pipeline, shop: Shop, orders: Orders, trace: Any) -> Check:
    torn = orders.torn
    title = "no event for an order that was never committed"
    phantom = sorted({s.order_id for s in pipe.stored if s.order_id not in shop.orders})
    unplaced = sorted(shop.orders - set(orders.placed))
    if unplaced:  # the grader's records: every order it placed went through checkout
        o = unplaced[0]
        return Check(
            "no_phantom_events", title, False,
            f"the shop's database holds {plural(len(unplaced), 'order')} the grader never placed ({o}): something"
            " other than checkout wrote them.",
            trace=trace(o), hint="only checkout writes orders and outbox rows, for the orders it is given",
        )  # fmt: skip
    if torn and torn in shop.orders and torn in set(shop.outbox.values()):
        return Check(
            "no_phantom_events", title, False,
            f"the grader killed checkout in the middle of {torn}'s transaction, yet the shop's database holds {torn}"
            " and its outbox row at the end: something other than checkout wrote them.",
            trace=trace(torn), hint="only checkout writes orders and outbox rows; the relay writes only its position",
        )  # fmt: skip
    if not phantom:
        return Check("no_phantom_events", title, True)
    return Check(
        "no_phantom_events",
        title,
        False,
        f"the stream stored events for {plural(len(phantom), 'order')} the shop's database does not hold: "
        f"{', '.join(x or '(no id in the body)' for x in phantom[:5])}.",
        trace=trace(phantom[0]),
        hint="publish only outbox rows, which commit with their order; publish the order as the JSON the row holds",
    )


def _published_once_check(stored: list[Stored], shop: Shop, down: float, trace: Any) -> Check:
    title = "each outbox row is stored once, under Nats-Msg-Id = its outbox id, even after a long relay outage"
    ids = {str(i): o for i, o in shop.outbox.items()}
    wrong = [s for s in stored if s.order_id in shop.orders and ids.get(s.msg_id) != s.order_id]
    if wrong:
        s = wrong[0]
        return Check(
            "published_once", title, False,
            f"the stream stored {s.order_id} with Nats-Msg-Id {s.msg_id or '(none)'}, not its outbox row's id: "
            "the stream cannot tell a resend of that row from a new event.",
            trace=trace(s.order_id), hint="publish each outbox row with Nats-Msg-Id set to the row's id",
        )  # fmt: skip
    seen: dict[str, list[Stored]] = {}
    for s in stored:
        seen.setdefault(s.order_id, []).append(s)
    twice = sorted(o for o, copies in seen.items() if len(copies) > 1)
    if not twice:
        return Check("published_once", title, True)
    after = [s for s in seen[twice[0]] if down and s.ts > down]
    why = (
        "after the relay restarted past the stream's duplicate window, it published a row the stream already held"
        if after
        else "the relay published one row more than once"
    )
    return Check(
        "published_once",
        title,
        False,
        f"{plural(len(twice), 'order')} stored more than once ({', '.join(twice[:3])}): {why}, "
        "and payments charges every stored event.",
        trace=trace(twice[0]),
        hint="before resuming, find out which rows the stream already holds (the saved position can lag behind it)",
    )


def _processed_once_check(charges: list[Any], shop: Shop, orders: Orders, trace: Any) -> Check:
    title = "every committed order is charged exactly once, and an order over the card limit never"
    per: dict[str, int] = {}
    for c in charges:
        per[str(c.reference)] = per.get(str(c.reference), 0) + 1
    over = {o for o in shop.orders if orders.expected(o) == "failed"}
    bad = sorted(o for o in shop.orders if per.get(o, 0) != (0 if o in over else 1))
    if not bad:
        return Check("processed_once", title, True)
    o = bad[0]
    return Check(
        "processed_once",
        title,
        False,
        f"{plural(len(bad), 'committed order')} charged other than {'never' if o in over else 'once'}; "
        f"{o} was charged {per.get(o, 0)} times.",
        trace=trace(o),
        hint="every committed order must reach the stream once: payments charges each stored event",
    )


def _correlation_check(pipe: Pipeline, orders: Orders, shop: Shop, trace: Any) -> Check:
    title = "every downstream effect carries its order's Correlation-Id"
    effects = [("the stream's event", s.order_id, s.correlation_id) for s in pipe.stored]
    effects += [(f"the status '{s.msg_id.rsplit('-', 1)[-1]}'", s.order_id, s.correlation_id) for s in pipe.statuses]
    effects += [(f"the dead letter on {d.subject}", d.order_id, d.correlation_id) for d in pipe.dead]
    effects += [(f"the receipt '{e.template}'", str(e.order_id), e.correlation_id or "") for e in pipe.sent()]
    for what, o, cid in effects:
        want = orders.correlation(o)
        if o in shop.orders and cid != want:
            return Check(
                "correlation_carried", title, False,
                f"{what} of {o} carried Correlation-Id {cid or '(none)'}, not the order's {want}.",
                trace=trace(o),
                hint="keep the order's correlation id in its outbox row's headers, and publish the row's headers",
            )  # fmt: skip
    return Check("correlation_carried", title, True)


def _status_check(pipe: Pipeline, shown: dict[str, str] | None, shop: Shop, orders: Orders, trace: Any) -> Check:
    title = (
        "the status view ends right for every order: confirmed, or failed (over the card limit) and in the payments DLQ"
    )
    if shown is None:
        return Check(
            "status_right", title, False, "the status page's process did not answer GET /orders at the end.",
            hint="every committed order must reach the stream (the page follows payments)",
        )  # fmt: skip
    wrong = sorted(o for o in shop.orders if shown.get(o) != orders.expected(o))
    extra = sorted(o for o in shown if o not in shop.orders)
    failed = sorted(o for o in shop.orders if orders.expected(o) == "failed")
    dead = [d for d in pipe.dead if d.subject == PAYMENTS_DLQ]
    undead = [o for o in failed if o not in {d.order_id for d in dead}]  # twice: a duplicate event's (published_once)
    if not wrong and not extra and not undead:
        return Check("status_right", title, True)
    if wrong:
        o = wrong[0]
        message = (
            f"{plural(len(wrong), 'committed order')} not shown as it ends; {o} shows {shown.get(o, 'nothing')}, "
            f"not {orders.expected(o)}."
        )
    elif extra:
        o = extra[0]
        message = f"the page shows {plural(len(extra), 'order')} that was never committed ({o})."
    else:
        o = undead[0]
        message = f"{o} (over the card limit) shows failed but is not in the payments DLQ."
    return Check(
        "status_right", title, False, message, trace=trace(o),
        hint="every committed order must reach the stream once (the page follows payments)",
    )  # fmt: skip


def _receipts_check(
    pipe: Pipeline, sent: list[Any], shown: dict[str, str] | None, shop: Shop, orders: Orders, trace: Any
) -> Check:
    title = "every committed order gets exactly one receipt (its status's), through an email outage"
    per: dict[str, list[str]] = {}
    for e in sent:
        per.setdefault(str(e.order_id), []).append(str(e.template))
    want = {o: shop_services.TEMPLATES[orders.expected(o)] for o in shop.orders}
    bad = sorted(o for o in shop.orders if per.get(o, []) != [want[o]])
    if not bad:
        return Check("receipts_once", title, True)
    o = bad[0]
    got = ", ".join(per.get(o, [])) or "none"
    return Check(
        "receipts_once", title, False,
        f"{plural(len(bad), 'committed order')} without exactly one receipt; {o} got {got} (wanted {want[o]}).",
        trace=trace(o), hint="every committed order must reach the stream (email follows payments' statuses)",
    )  # fmt: skip
