"""A small payment gateway for the course: its own process, its own SQLite store, spoken to over NATS.

It behaves like a card processor's charge API (Stripe's, say), on three request-reply subjects:

`<prefix>.charge` charges an account and answers with a charge id. A request is JSON with
`account`, `cents` and, as metadata, `reference` (or `payment_id`): a payment message can be sent
as it is. A request that carries an `Idempotency-Key` header is remembered for `window` seconds
(24 h is common in production): a repeat with the same key inside the window gets the first
charge back (`replayed: true`) instead of a second charge. As real gateways do, the gateway
refuses a key reused with different parameters (account, cents or reference): status 400,
`idempotency_key_reused`; and while the first request with a key is still being processed
(`latency` seconds: the card network's time), a second one with that key gets status 409,
`idempotency_key_in_use`, never a second charge. Without a key every request is a new charge,
which is how a retry becomes a double charge.

`<prefix>.search` finds charges by reference (Stripe lets you search charges by metadata). Like
Stripe's search it is eventually consistent: a charge shows up `search_lag` seconds after it was
made (60 s by default; "under a minute" is the common claim), so it answers "what did you charge
for this payment yesterday?", never "did my request a moment ago go through?".

`<prefix>.test_clock` (like Stripe's test clocks) moves the gateway's time forward, so a lesson or a
grader can let a key expire without waiting a day.

Run it:  python -m msglab.world.gateway --url nats://127.0.0.1:4222 --db gateway.sqlite --window 86400
From Python: `gw = msglab.world.gateway.start(window=86400)`, then `gw.charges()`,
`await gw.advance(nc, hours=25)`, `gw.stop()`; `await charge(nc, gw.subject, ...)` and
`await search(nc, gw.search_subject, reference)` are the client side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from msglab.grading.effects import open_sqlite

KEY_HEADER = "Idempotency-Key"
DEFAULT_WINDOW = 24 * 3600.0  # seconds; a common window for a payment provider's idempotency keys
DEFAULT_SEARCH_LAG = 60.0  # seconds (gateway clock) before a charge shows up in search

SCHEMA = """
create table if not exists charges (
    charge_id text primary key,
    account text not null,
    cents integer not null,
    reference text,              -- the caller's own id for the payment (metadata, never used to dedup)
    idempotency_key text,
    ts real not null,            -- real time
    created real not null        -- the gateway's clock (real time plus the test clock's offset)
);
create index if not exists charges_by_reference on charges (reference);
create table if not exists idempotency_keys (
    key text primary key,
    account text not null,       -- the parameters the key was first used with
    cents integer not null,
    reference text,
    charge_id text,              -- null while the first request is still being processed
    expires_at real not null     -- on the gateway's clock
);
create table if not exists requests (
    id integer primary key autoincrement,
    ts real not null,            -- real time
    at real not null,            -- the gateway's clock
    kind text not null,          -- 'charge' or 'search'
    reference text,
    idempotency_key text,
    charge_id text,
    replayed integer not null,
    outcome text not null        -- charged, replayed, reused (400), in_use (409), found N
);
create table if not exists clock (id integer primary key check (id = 1), offset real not null);
"""


class GatewayError(Exception):
    """The gateway refused a request; `status` is the HTTP-like status, `code` says why."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class IdempotencyKeyReused(GatewayError):
    """Status 400: this idempotency key was first used with other parameters (account, cents, reference)."""

    status = 400
    code = "idempotency_key_reused"


class IdempotencyKeyInUse(GatewayError):
    """Status 409: a request with this idempotency key is still being processed; nothing was charged."""

    status = 409
    code = "idempotency_key_in_use"


ERRORS: dict[str, type[GatewayError]] = {cls.code: cls for cls in (IdempotencyKeyReused, IdempotencyKeyInUse)}


def open_store(path: str) -> sqlite3.Connection:
    """The gateway's store: autocommit, WAL, and waiting (not failing) when a reader holds it."""
    return open_sqlite(path, SCHEMA)


class GatewayStore:
    """The gateway's bookkeeping: charges, remembered keys, every request, and the test clock."""

    def __init__(self, path: str, window: float, search_lag: float = DEFAULT_SEARCH_LAG, latency: float = 0.0) -> None:
        self.db = open_store(path)
        self.window = window
        self.search_lag = search_lag
        self.latency = latency

    def now(self) -> float:
        """The gateway's clock: real time plus what the test clock has been advanced by."""
        row = self.db.execute("select offset from clock where id = 1").fetchone()
        return time.time() + (row[0] if row else 0.0)

    def advance(self, seconds: float) -> float:
        """Move the gateway's clock forward; returns the new total offset."""
        self.db.execute(
            "insert into clock (id, offset) values (1, ?) "
            "on conflict(id) do update set offset = offset + excluded.offset",
            (seconds,),
        )
        return float(self.db.execute("select offset from clock where id = 1").fetchone()[0])

    async def charge(self, account: str, cents: int, reference: str | None, key: str | None) -> dict[str, Any]:
        """Charge once per key inside the window; without a key, charge every time.

        Raises IdempotencyKeyReused or IdempotencyKeyInUse. With `latency` 0 the whole request is
        one step; with a latency the key is taken first and the charge made `latency` s later,
        and a request with the same key in between gets IdempotencyKeyInUse.
        """
        cents = int(cents)
        now = self.now()
        if key:
            replay = self._claim_key(key, account, cents, reference, now)
            if replay is not None:
                return {**self._charge(replay), "replayed": True}
        if self.latency:
            await asyncio.sleep(self.latency)  # the card network at work; the key (if any) is in use meanwhile
        charge_id = "ch_" + secrets.token_hex(6)
        self.db.execute("begin immediate")
        try:
            self.db.execute(
                "insert into charges (charge_id, account, cents, reference, idempotency_key, ts, created) "
                "values (?, ?, ?, ?, ?, ?, ?)",
                (charge_id, account, cents, reference, key, time.time(), self.now()),
            )
            if key:
                self.db.execute("update idempotency_keys set charge_id = ? where key = ?", (charge_id, key))
            self._log("charge", reference, key, charge_id, "charged")
            self.db.execute("commit")
        except BaseException:
            self.db.execute("rollback")
            raise
        return {**self._charge(charge_id), "replayed": False}

    def _claim_key(self, key: str, account: str, cents: int, reference: str | None, now: float) -> str | None:
        """Take the key for a new charge (None), or return the charge id a live key already answers with."""
        self.db.execute("begin immediate")  # one writer at a time: checking the key and taking it are one step
        try:
            row = self.db.execute(
                "select account, cents, reference, charge_id, expires_at from idempotency_keys where key = ?", (key,)
            ).fetchone()
            if row and row[4] > now:
                if (row[0], row[1], row[2]) != (account, cents, reference):
                    self._log("charge", reference, key, row[3], "reused")
                    self.db.execute("commit")
                    raise IdempotencyKeyReused(
                        f"idempotency key {key!r} was first used for account {row[0]}, {row[1]} cents, "
                        f"reference {row[2]!r}; this request asks for account {account}, {cents} cents, "
                        f"reference {reference!r}. A key names one operation: it cannot be reused with other "
                        "parameters"
                    )
                if row[3] is None:
                    self._log("charge", reference, key, None, "in_use")
                    self.db.execute("commit")
                    raise IdempotencyKeyInUse(
                        f"a request with idempotency key {key!r} is still being processed; nothing was charged "
                        "by this one. Retry later: the retry gets the first request's charge"
                    )
                self._log("charge", reference, key, row[3], "replayed")
                self.db.execute("commit")
                return str(row[3])
            # A new key, or one whose window is over: it is forgotten and starts afresh.
            self.db.execute(
                "insert into idempotency_keys (key, account, cents, reference, charge_id, expires_at) "
                "values (?, ?, ?, ?, null, ?) on conflict(key) do update set account = excluded.account, "
                "cents = excluded.cents, reference = excluded.reference, charge_id = null, "
                "expires_at = excluded.expires_at",
                (key, account, cents, reference, now + self.window),
            )
            self.db.execute("commit")
        except GatewayError:
            raise
        except BaseException:
            self.db.execute("rollback")
            raise
        return None

    def search(self, reference: str) -> list[dict[str, Any]]:
        """Charges made for `reference` at least `search_lag` seconds ago (gateway clock), oldest first."""
        visible_until = self.now() - self.search_lag
        rows = self.db.execute(
            "select charge_id from charges where reference = ? and created <= ? order by created",
            (reference, visible_until),
        ).fetchall()
        self._log("search", reference, None, None, f"found {len(rows)}")
        return [self._charge(row[0]) for row in rows]

    def _charge(self, charge_id: str) -> dict[str, Any]:
        row = self.db.execute(
            "select charge_id, account, cents, reference, created from charges where charge_id = ?", (charge_id,)
        ).fetchone()
        return {"charge_id": row[0], "account": row[1], "cents": row[2], "reference": row[3], "created": row[4]}

    def _log(self, kind: str, reference: str | None, key: str | None, charge_id: str | None, outcome: str) -> None:
        self.db.execute(
            "insert into requests (ts, at, kind, reference, idempotency_key, charge_id, replayed, outcome) "
            "values (?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), self.now(), kind, reference, key, charge_id, int(outcome == "replayed"), outcome),
        )


def _error_reply(exc: GatewayError) -> dict[str, Any]:
    return {"error": str(exc), "status": exc.status, "code": exc.code}


async def _respond(msg: Any, reply: dict[str, Any]) -> None:
    """Answer a request; a message with no reply subject, or a requester gone, is simply dropped."""
    with contextlib.suppress(Exception):
        await msg.respond(json.dumps(reply).encode())


async def _subscribe(nc: Any, store: GatewayStore, prefix: str) -> list[Any]:
    """Answer `<prefix>.charge`, `<prefix>.search` and `<prefix>.test_clock` on nc; returns the subscriptions.

    Whatever arrives is someone else's bytes: a request the gateway cannot parse gets an error reply,
    never an exception inside the gateway, and a message with no reply subject is dropped unread.
    """
    running: set[asyncio.Task[None]] = set()

    async def charge_one(msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            key = (msg.headers or {}).get(KEY_HEADER) or None
            # The caller's own id for the payment, kept as metadata: `reference`, or a payment's `payment_id`.
            reference = body.get("reference", body.get("payment_id"))
            reference = None if reference is None else str(reference)
            reply = await store.charge(str(body["account"]), int(body["cents"]), reference, key)
        except GatewayError as exc:
            reply = _error_reply(exc)
        except Exception as exc:
            reply = _error_reply(
                GatewayError(f"bad charge request: {exc!r}"[:300] + "; send JSON with account and cents")
            )
        await _respond(msg, reply)

    async def on_charge(msg: Any) -> None:
        if not msg.reply:
            return
        # Each request runs as a task of its own, as on a real server: requests overlap in time, so two
        # with one key can meet while the first is in flight (the key's state, not luck, decides).
        task = asyncio.ensure_future(charge_one(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    async def on_search(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            reference = json.loads(msg.data or b"{}")["reference"]
            if not isinstance(reference, str) or not reference:
                raise TypeError(f"reference must be a non-empty string, got {reference!r}")
            reply: dict[str, Any] = {"charges": store.search(reference), "lag": store.search_lag}
        except Exception as exc:
            reply = _error_reply(GatewayError(f"bad search request: {exc!r}"[:300] + "; send JSON with a reference"))
        await _respond(msg, reply)

    async def on_clock(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            seconds = float(json.loads(msg.data or b"{}").get("seconds", 0))
            if not math.isfinite(seconds) or seconds < 0:
                raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
            reply: dict[str, Any] = {"offset": store.advance(seconds)}
        except Exception as exc:
            reply = _error_reply(GatewayError(f"bad test_clock request: {exc!r}"[:300]))
        await _respond(msg, reply)

    subs = [
        await nc.subscribe(f"{prefix}.charge", cb=on_charge),
        await nc.subscribe(f"{prefix}.search", cb=on_search),
        await nc.subscribe(f"{prefix}.test_clock", cb=on_clock),
    ]
    from msglab.broker import settle_subscriptions

    await settle_subscriptions(nc)
    return subs


async def serve(
    url: str,
    db_path: str,
    prefix: str = "gateway",
    window: float = DEFAULT_WINDOW,
    ready: Any = None,
    *,
    search_lag: float = DEFAULT_SEARCH_LAG,
    latency: float = 0.0,
) -> None:
    """The gateway process's life: connect, answer requests until cancelled."""
    import nats

    from msglab.broker import tls_options

    async def quiet(_: Exception) -> None:
        """A server that restarts (lab 07 restarts one) is reconnected to: nothing to print into a verdict."""

    nc = await nats.connect(
        url, name="msglab-gateway", max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet,
        **tls_options(url),
    )  # fmt: skip
    await _subscribe(nc, GatewayStore(db_path, window, search_lag, latency), prefix)
    if ready is not None:
        ready()
    try:
        await asyncio.Event().wait()
    finally:
        await nc.close()


async def charge(
    nc: Any,
    subject: str,
    account: str,
    cents: int,
    *,
    reference: str | None = None,
    idempotency_key: str | None = None,
    timeout: float = 2.0,
) -> dict[str, Any]:
    """Client side: one charge request; the key, when given, travels as the Idempotency-Key header.

    Raises IdempotencyKeyReused (400), IdempotencyKeyInUse (409) or GatewayError (a bad request).
    """
    headers = {KEY_HEADER: str(idempotency_key)} if idempotency_key else None
    body = json.dumps({"account": account, "cents": cents, "reference": reference}).encode()
    reply = await nc.request(subject, body, timeout=timeout, headers=headers)
    return _answer(json.loads(reply.data))


async def search(nc: Any, subject: str, reference: str, *, timeout: float = 2.0) -> list[dict[str, Any]]:
    """Client side: the charges the gateway's search shows for `reference` (it lags behind; see the module)."""
    reply = await nc.request(subject, json.dumps({"reference": reference}).encode(), timeout=timeout)
    return list(_answer(json.loads(reply.data))["charges"])


def _answer(answer: dict[str, Any]) -> dict[str, Any]:
    if "error" in answer:
        cls = ERRORS.get(str(answer.get("code")), GatewayError)
        raise cls(str(answer["error"]), int(answer.get("status", cls.status)), str(answer.get("code", cls.code)))
    return answer


@dataclass
class Charge:
    """One charge as the gateway recorded it."""

    charge_id: str
    account: str
    cents: int
    reference: str | None
    idempotency_key: str | None
    ts: float  # real time
    created: float = 0.0  # the gateway's clock


@dataclass
class Request:
    """One request as the gateway saw it (replayed: a charge request answered with an earlier charge)."""

    ts: float
    reference: str | None
    idempotency_key: str | None
    charge_id: str | None
    replayed: bool
    kind: str = "charge"  # or "search"
    outcome: str = ""  # charged, replayed, reused, in_use, found N
    at: float = 0.0  # the gateway's clock


class GatewayView:
    """Where a gateway answers, and read access to its store."""

    def __init__(self, db_path: str, prefix: str, window: float, search_lag: float = DEFAULT_SEARCH_LAG) -> None:
        self.db_path = db_path
        self.prefix = prefix
        self.window = window
        self.search_lag = search_lag

    @property
    def subject(self) -> str:
        """Where charge requests go, e.g. 'gateway.charge'."""
        return f"{self.prefix}.charge"

    @property
    def search_subject(self) -> str:
        """Where search requests go, e.g. 'gateway.search'."""
        return f"{self.prefix}.search"

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(self.db_path, timeout=10)
        try:
            db.execute("pragma busy_timeout=10000")
            return db.execute(sql, args).fetchall()
        finally:
            db.close()

    def charges(self, reference: str | None = None) -> list[Charge]:
        """Every charge made (optionally for one reference), oldest first: the store, not the lagging search."""
        sql = "select charge_id, account, cents, reference, idempotency_key, ts, created from charges"
        if reference:
            sql, args = sql + " where reference = ?", (reference,)
        rows = self._read(sql + " order by ts", args if reference else ())
        return [Charge(*row) for row in rows]

    def requests(self, kind: str = "charge") -> list[Request]:
        """Every request of that kind ('charge' or 'search') received, oldest first."""
        rows = self._read(
            "select ts, reference, idempotency_key, charge_id, replayed, kind, outcome, at from requests "
            "where kind = ? order by id",
            (kind,),
        )
        return [Request(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6], r[7]) for r in rows]

    async def advance(self, nc: Any, *, hours: float = 0.0, seconds: float = 0.0) -> float:
        """Move the gateway's test clock forward; returns its total offset in seconds."""
        body = json.dumps({"seconds": hours * 3600 + seconds}).encode()
        reply = await nc.request(f"{self.prefix}.test_clock", body, timeout=2)
        return float(_answer(json.loads(reply.data))["offset"])

    async def search(self, nc: Any, reference: str) -> list[dict[str, Any]]:
        """Ask the gateway's search (over NATS, so with its lag) for the charges of one reference."""
        return await search(nc, self.search_subject, reference)


class AttachedGateway(GatewayView):
    """A gateway served on a connection of the caller's own (see attach)."""

    def __init__(self, db_path: str, prefix: str, window: float, subs: list[Any], search_lag: float) -> None:
        super().__init__(db_path, prefix, window, search_lag)
        self.subs = subs

    async def stop(self) -> None:
        """Stop answering."""
        for sub in self.subs:
            await sub.unsubscribe()


async def attach(
    nc: Any,
    db_path: str,
    *,
    prefix: str = "gateway",
    window: float = DEFAULT_WINDOW,
    search_lag: float = DEFAULT_SEARCH_LAG,
    latency: float = 0.0,
) -> AttachedGateway:
    """Serve the gateway on an existing connection, in this process, with its own store at db_path.

    A grader uses this to save starting one more process; it is the same service over NATS either way.
    """
    subs = await _subscribe(nc, GatewayStore(db_path, window, search_lag, latency), prefix)
    return AttachedGateway(db_path, prefix, window, subs, search_lag)


class Gateway(GatewayView):
    """A running gateway process and read access to its store."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        db_path: str,
        prefix: str,
        window: float,
        url: str,
        search_lag: float = DEFAULT_SEARCH_LAG,
    ) -> None:
        super().__init__(db_path, prefix, window, search_lag)
        self.proc = proc
        self.url = url
        self.own_folder: str | None = None  # a temp folder start() made for the store, removed by stop(remove=True)

    @property
    def pid(self) -> int:
        """The gateway process's id."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """Whether the gateway process is still running."""
        return self.proc.poll() is None

    def stop(self, remove: bool = False) -> None:
        """Stop the process (SIGTERM, then SIGKILL); the store stays for reading unless remove is set."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if remove and self.own_folder:
            shutil.rmtree(self.own_folder, ignore_errors=True)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        hours = self.window / 3600
        return f"<Gateway pid {self.pid} {state}: {self.subject}, keys kept {hours:g} h, store {self.db_path}>"


def start(
    url: str | None = None,
    *,
    db_path: str | None = None,
    prefix: str = "gateway",
    window: float = DEFAULT_WINDOW,
    search_lag: float = DEFAULT_SEARCH_LAG,
    latency: float = 0.0,
    ready_timeout: float = 10.0,
) -> Gateway:
    """Start a gateway process and return once it answers on NATS (url: the course's server by default)."""
    from msglab.broker.server import die_with_parent

    if url is None:
        from msglab.broker import server_url

        url = server_url()
    own_folder = None
    if db_path is None:
        own_folder = tempfile.mkdtemp(prefix="msglab-gateway-")
        db_path = os.path.join(own_folder, "gateway.sqlite")
    open_store(db_path).close()  # the schema exists before anyone reads the store
    args = [sys.executable, "-m", "msglab.world.gateway", "--db", db_path]
    args += ["--prefix", prefix, "--window", str(window), "--search-lag", str(search_lag), "--latency", str(latency)]
    proc = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    # On stdin, not the command line: a room's URL carries a learner's password, and any user may read argv.
    proc.stdin.write(url.encode() + b"\n")
    proc.stdin.close()
    readable, _, _ = select.select([proc.stdout], [], [], ready_timeout)
    line = proc.stdout.readline() if readable else b""
    if b"ready" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the gateway process did not start (it said {line!r})")
    gateway = Gateway(proc, db_path, prefix, window, url, search_lag)
    gateway.own_folder = own_folder
    return gateway


def main(argv: list[str] | None = None) -> None:
    """`python -m msglab.world.gateway`: serve until SIGTERM, saying `ready` on stdout once subscribed."""
    parser = argparse.ArgumentParser(prog="python -m msglab.world.gateway", description="The course's payment gateway.")
    parser.add_argument("--url", help="NATS server URL (default: the first line of stdin)")
    parser.add_argument("--db", required=True, help="SQLite file for the gateway's store")
    parser.add_argument("--prefix", default="gateway", help="subjects <prefix>.charge, .search, .test_clock")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW, help="seconds an idempotency key is kept")
    parser.add_argument(
        "--search-lag", type=float, default=DEFAULT_SEARCH_LAG, help="seconds before a charge shows up in search"
    )
    parser.add_argument("--latency", type=float, default=0.0, help="seconds a charge is in flight (409 meanwhile)")
    args = parser.parse_args(argv)
    url = args.url or sys.stdin.readline().strip()

    def ready() -> None:
        print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # a stop is a normal end
        asyncio.run(
            serve(url, args.db, args.prefix, args.window, ready, search_lag=args.search_lag, latency=args.latency)
        )


if __name__ == "__main__":
    main()
