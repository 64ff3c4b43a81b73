"""A small payment gateway for the course: its own process, its own SQLite store, spoken to over NATS.

It behaves like a card processor's charge API (Stripe's, say): a request-reply service on
`<prefix>.charge` that charges an account and answers with a charge id. A request is JSON with
`account`, `cents` and, as metadata, `reference` (or `payment_id`): a payment message can be sent
as it is. A request that carries an
`Idempotency-Key` header is remembered for `window` seconds (the seeds' production figure is 24 h):
a repeat with the same key inside the window gets the first charge back (`replayed: true`) instead
of a second charge. Without a key every request is a new charge, which is how a retry becomes a
double charge.

A test clock (`<prefix>.test_clock`, like Stripe's test clocks) moves the gateway's time forward, so
a lesson can show a key expiring without waiting a day.

Run it:  python -m msglab.world.gateway --url nats://127.0.0.1:4222 --db gateway.sqlite --window 86400
From Python: `gw = msglab.gateway.start(window=86400)`, then `gw.charges()`, `await gw.advance(nc, hours=25)`,
`gw.stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
DEFAULT_WINDOW = 24 * 3600.0  # seconds; the seeds' figure for a payment provider's key window

SCHEMA = """
create table if not exists charges (
    charge_id text primary key,
    account text not null,
    cents integer not null,
    reference text,              -- the caller's own id for the payment (metadata, never used to dedup)
    idempotency_key text,
    ts real not null
);
create table if not exists idempotency_keys (
    key text primary key,
    charge_id text not null,
    expires_at real not null     -- on the gateway's clock (real time plus the test clock's offset)
);
create table if not exists requests (
    id integer primary key autoincrement,
    ts real not null,
    reference text,
    idempotency_key text,
    charge_id text,
    replayed integer not null
);
create table if not exists clock (id integer primary key check (id = 1), offset real not null);
"""


def open_store(path: str) -> sqlite3.Connection:
    """The gateway's store: autocommit, WAL, and waiting (not failing) when a reader holds it."""
    return open_sqlite(path, SCHEMA)


class GatewayStore:
    """The gateway's bookkeeping: charges, remembered keys, every request, and the test clock."""

    def __init__(self, path: str, window: float) -> None:
        self.db = open_store(path)
        self.window = window

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

    def charge(self, account: str, cents: int, reference: str | None, key: str | None) -> dict[str, Any]:
        """Charge once per key inside the window; without a key, charge every time."""
        now = self.now()
        self.db.execute("begin immediate")  # one writer at a time: the key check and the charge are one step
        try:
            if key:
                row = self.db.execute(
                    "select charge_id, expires_at from idempotency_keys where key = ?", (key,)
                ).fetchone()
                if row and row[1] > now:
                    self._log(reference, key, row[0], True)
                    self.db.execute("commit")
                    return {**self._charge(row[0]), "replayed": True}
            charge_id = "ch_" + secrets.token_hex(6)
            self.db.execute(
                "insert into charges (charge_id, account, cents, reference, idempotency_key, ts) "
                "values (?, ?, ?, ?, ?, ?)",
                (charge_id, account, int(cents), reference, key, time.time()),
            )
            if key:
                self.db.execute(
                    "insert into idempotency_keys (key, charge_id, expires_at) values (?, ?, ?) "
                    "on conflict(key) do update set charge_id = excluded.charge_id, expires_at = excluded.expires_at",
                    (key, charge_id, now + self.window),
                )
            self._log(reference, key, charge_id, False)
            self.db.execute("commit")
        except BaseException:
            self.db.execute("rollback")
            raise
        return {**self._charge(charge_id), "replayed": False}

    def _charge(self, charge_id: str) -> dict[str, Any]:
        row = self.db.execute(
            "select charge_id, account, cents, reference from charges where charge_id = ?", (charge_id,)
        ).fetchone()
        return {"charge_id": row[0], "account": row[1], "cents": row[2], "reference": row[3]}

    def _log(self, reference: str | None, key: str | None, charge_id: str, replayed: bool) -> None:
        self.db.execute(
            "insert into requests (ts, reference, idempotency_key, charge_id, replayed) values (?, ?, ?, ?, ?)",
            (time.time(), reference, key, charge_id, int(replayed)),
        )


async def _subscribe(nc: Any, store: GatewayStore, prefix: str) -> list[Any]:
    """Answer `<prefix>.charge` and `<prefix>.test_clock` on nc from store; returns the subscriptions."""

    async def on_charge(msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            key = (msg.headers or {}).get(KEY_HEADER) or None
            # The caller's own id for the payment, kept as metadata: `reference`, or a payment's `payment_id`.
            reference = body.get("reference", body.get("payment_id"))
            reply = store.charge(str(body["account"]), int(body["cents"]), reference, key)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"error": f"bad charge request: {exc!r}; send JSON with account and cents"}
        await msg.respond(json.dumps(reply).encode())

    async def on_clock(msg: Any) -> None:
        seconds = float(json.loads(msg.data or b"{}").get("seconds", 0))
        await msg.respond(json.dumps({"offset": store.advance(seconds)}).encode())

    # Callbacks of one subscription run one at a time: two requests with the same key never interleave.
    subs = [
        await nc.subscribe(f"{prefix}.charge", cb=on_charge),
        await nc.subscribe(f"{prefix}.test_clock", cb=on_clock),
    ]
    await nc.flush()
    return subs


async def serve(
    url: str, db_path: str, prefix: str = "gateway", window: float = DEFAULT_WINDOW, ready: Any = None
) -> None:
    """The gateway process's life: connect, answer requests until cancelled."""
    import nats

    nc = await nats.connect(url, name="msglab-gateway", max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await _subscribe(nc, GatewayStore(db_path, window), prefix)
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
    """Client side: one charge request; the key, when given, travels as the Idempotency-Key header."""
    headers = {KEY_HEADER: str(idempotency_key)} if idempotency_key else None
    body = json.dumps({"account": account, "cents": cents, "reference": reference}).encode()
    reply = await nc.request(subject, body, timeout=timeout, headers=headers)
    answer = json.loads(reply.data)
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer


@dataclass
class Charge:
    """One charge as the gateway recorded it."""

    charge_id: str
    account: str
    cents: int
    reference: str | None
    idempotency_key: str | None
    ts: float


@dataclass
class Request:
    """One charge request as the gateway saw it (replayed: answered with an earlier charge)."""

    ts: float
    reference: str | None
    idempotency_key: str | None
    charge_id: str
    replayed: bool


class GatewayView:
    """Where a gateway answers, and read access to its store."""

    def __init__(self, db_path: str, prefix: str, window: float) -> None:
        self.db_path = db_path
        self.prefix = prefix
        self.window = window

    @property
    def subject(self) -> str:
        """Where charge requests go, e.g. 'gateway.charge'."""
        return f"{self.prefix}.charge"

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(self.db_path, timeout=10)
        try:
            db.execute("pragma busy_timeout=10000")
            return db.execute(sql, args).fetchall()
        finally:
            db.close()

    def charges(self, reference: str | None = None) -> list[Charge]:
        """Every charge made (optionally for one reference), oldest first."""
        sql = "select charge_id, account, cents, reference, idempotency_key, ts from charges"
        if reference:
            sql, args = sql + " where reference = ?", (reference,)
        rows = self._read(sql + " order by ts", args if reference else ())
        return [Charge(*row) for row in rows]

    def requests(self) -> list[Request]:
        """Every charge request received, oldest first."""
        rows = self._read("select ts, reference, idempotency_key, charge_id, replayed from requests order by id")
        return [Request(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]

    async def advance(self, nc: Any, *, hours: float = 0.0, seconds: float = 0.0) -> float:
        """Move the gateway's test clock forward; returns its total offset in seconds."""
        body = json.dumps({"seconds": hours * 3600 + seconds}).encode()
        reply = await nc.request(f"{self.prefix}.test_clock", body, timeout=2)
        return float(json.loads(reply.data)["offset"])


class AttachedGateway(GatewayView):
    """A gateway served on a connection of the caller's own (see attach)."""

    def __init__(self, db_path: str, prefix: str, window: float, subs: list[Any]) -> None:
        super().__init__(db_path, prefix, window)
        self.subs = subs

    async def stop(self) -> None:
        """Stop answering."""
        for sub in self.subs:
            await sub.unsubscribe()


async def attach(nc: Any, db_path: str, *, prefix: str = "gateway", window: float = DEFAULT_WINDOW) -> AttachedGateway:
    """Serve the gateway on an existing connection, in this process, with its own store at db_path.

    A grader uses this to save starting one more process; it is the same service over NATS either way.
    """
    subs = await _subscribe(nc, GatewayStore(db_path, window), prefix)
    return AttachedGateway(db_path, prefix, window, subs)


class Gateway(GatewayView):
    """A running gateway process and read access to its store."""

    def __init__(self, proc: subprocess.Popen[bytes], db_path: str, prefix: str, window: float, url: str) -> None:
        super().__init__(db_path, prefix, window)
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
    args = [sys.executable, "-m", "msglab.world.gateway", "--url", url, "--db", db_path]
    args += ["--prefix", prefix, "--window", str(window)]
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )  # fmt: skip
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], ready_timeout)
    line = proc.stdout.readline() if readable else b""
    if b"ready" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the gateway process did not start (it said {line!r})")
    gateway = Gateway(proc, db_path, prefix, window, url)
    gateway.own_folder = own_folder
    return gateway


def main(argv: list[str] | None = None) -> None:
    """`python -m msglab.world.gateway`: serve until SIGTERM, saying `ready` on stdout once subscribed."""
    parser = argparse.ArgumentParser(prog="python -m msglab.world.gateway", description="The course's payment gateway.")
    parser.add_argument("--url", required=True, help="NATS server URL")
    parser.add_argument("--db", required=True, help="SQLite file for the gateway's store")
    parser.add_argument("--prefix", default="gateway", help="subject prefix: <prefix>.charge, <prefix>.test_clock")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW, help="seconds an idempotency key is kept")
    args = parser.parse_args(argv)

    def ready() -> None:
        print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # a stop is a normal end
        asyncio.run(serve(args.url, args.db, args.prefix, args.window, ready))


if __name__ == "__main__":
    main()
