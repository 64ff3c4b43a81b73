"""A small transactional email provider for the course: its own process, its own SQLite store, over NATS.

It behaves like an email API (Postmark's, SendGrid's): a request asks it to send one templated email,
and it answers with a message id, or with an error that carries an HTTP status. Nothing in an error
says "transient" or "permanent"; the caller judges that from the status, as with a real API:

    503 Service Unavailable   the provider is down (an outage, a deploy)           retry later
    429 Too Many Requests     the caller is over its rate limit                   retry later
    502 Bad Gateway           the recipient's mail server is not answering        retry later
    connection reset          the connection dropped (ConnectionResetError)       retry later, but it may
                                                                                  have been sent already
    400 Bad Request           the request names a template that does not exist     the same request fails again
    422 Unprocessable Entity  the recipient's mailbox does not exist               the same request fails again

On NATS: `<prefix>.send` takes JSON {"to", "template", "order_id"} and answers {"message_id": ...}
or {"error": text, "status": code} (status 0 with "reset": true for a dropped connection);
`<prefix>.control` changes how it behaves (an outage of some seconds, a missing mailbox, an
unknown template, an unreachable recipient domain, scripted failures for one address), as a
lesson or a grader needs. Every request and every email sent is a row in its store.

A dropped connection is ambiguous: the scripted answer `reset_after_send` sends the email, then
answers as a reset, so the caller cannot tell it went out. A request with an `Idempotency-Key`
header (as Resend's API takes one) is sent once per key: a repeat gets the first email's id back
with "replayed": true and sends nothing. Keys are kept for the store's life; without one, every
request that gets through is a new email.

Run it:  python -m msglab.world.email_provider --url nats://127.0.0.1:4222 --db provider.sqlite
From Python: `provider = start()` (its own process) or `await attach(nc, db_path)` (served on a
connection of the caller's own), then `await send(nc, provider.subject, email)` as a client,
`provider.sent()` and `provider.requests()` to read its store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from msglab.grading.effects import open_sqlite

TEMPLATES = ("order_confirmation", "order_shipped")  # the templates the provider knows at start

SCHEMA = """
create table if not exists emails (
    message_id text primary key,
    order_id text,
    to_addr text not null,
    template text not null,
    ts real not null,
    correlation_id text          -- the request's Correlation-Id header, if it had one
);
create table if not exists requests (
    id integer primary key autoincrement,
    ts real not null,
    order_id text,
    to_addr text,
    template text,
    status integer not null,     -- 200 sent, else the error status (0: connection reset)
    outcome text not null,        -- 'sent' or the error text ('sent, then reset', 'replayed': a key's repeat)
    correlation_id text
);
create table if not exists idempotency_keys (
    key text primary key,
    message_id text not null,
    ts real not null
);
"""

KEY_HEADER = "Idempotency-Key"
CORRELATION_HEADER = "Correlation-Id"  # kept with the request and the email it sent (module 07 traces by it)
RESET = "[Errno 104] Connection reset by peer"
SENT_THEN_RESET = "sent, then reset"  # Behaviour.answer's text for a 200 whose answer the caller never gets
_STATUS = re.compile(r"^\s*(\d{3})\b")


class EmailApiError(Exception):
    """The provider answered with an error status; `status` is that HTTP status (e.g. 503, 422).

    Made from the provider's text alone (`EmailApiError("422 Unprocessable Entity: ...")`), the
    status is read from its first three digits.
    """

    def __init__(self, message: str = "", status: int | None = None) -> None:
        super().__init__(message)
        if status is None:
            match = _STATUS.match(message)
            status = int(match.group(1)) if match else 0
        self.status = status


def domain_of(address: str) -> str:
    return address.rsplit("@", 1)[-1].lower()


@dataclass
class Behaviour:
    """What the provider does right now; changed over `<prefix>.control` (or directly, when attached)."""

    down_until: float = 0.0  # time.time() until which every request gets 503
    armed: float = 0.0  # an outage of this many seconds that starts with the next request
    templates: set[str] = field(default_factory=lambda: set(TEMPLATES))
    missing_mailboxes: set[str] = field(default_factory=set)
    unreachable_domains: set[str] = field(default_factory=set)
    # address -> next answers: 503, 502, 429, reset, reset_after_send (sent, then the connection drops)
    scripted: dict[str, list[str]] = field(default_factory=dict)

    def control(self, op: str, **args: Any) -> dict[str, Any]:
        """Apply one control operation; returns what the provider now does."""
        if op == "outage":
            if args.get("from_next_request"):
                self.armed = float(args.get("seconds", 0))
            else:
                self.down_until = time.time() + float(args.get("seconds", 0))
        elif op == "template":
            (self.templates.add if args.get("known", True) else self.templates.discard)(str(args["name"]))
        elif op == "mailbox":
            address = str(args["address"]).lower()
            if args.get("exists", True):
                self.missing_mailboxes.discard(address)
            else:
                self.missing_mailboxes.add(address)
        elif op == "domain":
            name = str(args["name"]).lower()
            if args.get("reachable", True):
                self.unreachable_domains.discard(name)
            else:
                self.unreachable_domains.add(name)
        elif op == "script":
            self.scripted[str(args["address"]).lower()] = [str(a) for a in args.get("answers", [])]
        elif op == "reset":
            fresh = Behaviour()
            self.__dict__.update(fresh.__dict__)
        else:
            raise ValueError(f"unknown control operation {op!r}")
        return self.describe()

    def describe(self) -> dict[str, Any]:
        return {
            "down_for": max(0.0, round(self.down_until - time.time(), 3)),
            "down_from_next_request_for": self.armed,
            "templates": sorted(self.templates),
            "missing_mailboxes": sorted(self.missing_mailboxes),
            "unreachable_domains": sorted(self.unreachable_domains),
        }

    def answer(self, to: str, template: str) -> tuple[int, str]:
        """(status, text) for one send request: 200 and '' when the email goes out; 200 and SENT_THEN_RESET
        when it goes out and the caller gets a reset instead of the answer."""
        address = to.lower()
        if self.armed:
            self.down_until, self.armed = time.time() + self.armed, 0.0
        if time.time() < self.down_until:
            return 503, "503 Service Unavailable: the provider is down for maintenance, try again later"
        script = self.scripted.get(address)
        if script:
            scripted = script.pop(0)
            if scripted == "reset":
                return 0, RESET
            if scripted == "reset_after_send":
                status, text = self._deliverable(to, template)
                return (200, SENT_THEN_RESET) if status == 200 else (status, text)
            if scripted == "429":
                return 429, "429 Too Many Requests: rate limit of 10 emails per second exceeded, slow down"
            if scripted == "502":
                return 502, f"502 Bad Gateway: the receiving mail server for {domain_of(address)} timed out"
            return 503, "503 Service Unavailable: the provider is overloaded, try again later"
        return self._deliverable(to, template)

    def _deliverable(self, to: str, template: str) -> tuple[int, str]:
        """The answer to a request that reaches the sending step: the template, the mailbox, the domain."""
        address = to.lower()
        if template not in self.templates:
            return 400, f"400 Bad Request: unknown template {template!r}"
        if address in self.missing_mailboxes:
            return 422, f"422 Unprocessable Entity: recipient {to} rejected: mailbox does not exist"
        domain = domain_of(address)
        if domain in self.unreachable_domains:
            return 502, f"502 Bad Gateway: the receiving mail server for {domain} is not answering, try again later"
        return 200, ""


class ProviderStore:
    """The provider's bookkeeping: every request, every email sent."""

    def __init__(self, path: str) -> None:
        self.db = open_sqlite(path, SCHEMA)

    def handle(
        self, behaviour: Behaviour, email: Any, key: str | None = None, correlation_id: str | None = None
    ) -> dict[str, Any]:
        """One send request: decide, record, and return the reply; `key` is its Idempotency-Key, if any,
        `correlation_id` its Correlation-Id (kept with the request and the email, as a real API keeps metadata)."""
        if not isinstance(email, dict) or not isinstance(email.get("to"), str) or "@" not in email["to"]:
            status, text = 400, "400 Bad Request: 'to' must be an email address"
            to, template = None, None
        elif not isinstance(email.get("template"), str):
            status, text = 400, "400 Bad Request: 'template' is required"
            to, template = email["to"], None
        else:
            to, template = email["to"], email["template"]
            status, text = behaviour.answer(to, template)
        order_id = email.get("order_id") if isinstance(email, dict) else None
        order_id = None if order_id is None else str(order_id)
        reply: dict[str, Any]
        outcome = text
        if status == 200:
            seen = self.db.execute("select message_id from idempotency_keys where key = ?", (key,)).fetchone()
            if seen is not None:  # a repeat of a keyed request: the first email's id, nothing sent
                reply, outcome = {"message_id": seen[0], "replayed": True}, "replayed"
            else:
                message_id = "em_" + secrets.token_hex(6)
                self.db.execute(
                    "insert into emails (message_id, order_id, to_addr, template, ts, correlation_id)"
                    " values (?, ?, ?, ?, ?, ?)",
                    (message_id, order_id, to, template, time.time(), correlation_id),
                )
                if key is not None:
                    self.db.execute(
                        "insert into idempotency_keys (key, message_id, ts) values (?, ?, ?)",
                        (key, message_id, time.time()),
                    )
                reply, outcome = {"message_id": message_id}, "sent"
            if text == SENT_THEN_RESET:  # the email went out (or was out already); the answer is lost
                reply, outcome = {"error": RESET, "status": 0, "reset": True}, f"{outcome}, then reset"
        elif status == 0:
            reply = {"error": text, "status": 0, "reset": True}
        else:
            reply = {"error": text, "status": status}
        self.db.execute(
            "insert into requests (ts, order_id, to_addr, template, status, outcome, correlation_id)"
            " values (?, ?, ?, ?, ?, ?, ?)",
            (time.time(), order_id, to, template, status, outcome, correlation_id),
        )
        return reply


async def _respond(msg: Any, reply: dict[str, Any]) -> None:
    """Answer a request; a message with no reply subject, or a requester gone, is simply dropped."""
    with contextlib.suppress(Exception):
        await msg.respond(json.dumps(reply).encode())


async def _subscribe(nc: Any, store: ProviderStore, behaviour: Behaviour, prefix: str) -> list[Any]:
    # Whatever arrives is someone else's bytes: nothing in them may raise inside the provider (a
    # traceback in the grader's process, or a grading error blamed on the course). A message nobody
    # waits for (no reply subject) is dropped before any work, so a flood of them costs next to nothing.
    async def on_send(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            email = json.loads(msg.data)
        except ValueError:
            email = None
        key = (msg.headers or {}).get(KEY_HEADER) or None
        correlation_id = (msg.headers or {}).get(CORRELATION_HEADER) or None
        try:
            reply = store.handle(behaviour, email, key, correlation_id)
        except Exception as exc:
            reply = {"error": f"400 Bad Request: {type(exc).__name__}", "status": 400}
        await _respond(msg, reply)

    async def on_control(msg: Any) -> None:
        if not msg.reply:
            return
        try:
            request = json.loads(msg.data or b"{}")
            reply: dict[str, Any] = behaviour.control(**request)
        except Exception as exc:
            reply = {"error": f"bad control request: {exc!r}"[:300]}
        await _respond(msg, reply)

    subs = [await nc.subscribe(f"{prefix}.send", cb=on_send), await nc.subscribe(f"{prefix}.control", cb=on_control)]
    from msglab.broker import settle_subscriptions

    await settle_subscriptions(nc)
    return subs


# --- the client side ---------------------------------------------------------------------------


def error_from_reply(reply: dict[str, Any]) -> Exception:
    """The exception a client raises for an error reply: EmailApiError, or ConnectionResetError."""
    if reply.get("reset"):
        return ConnectionResetError(str(reply.get("error", "connection reset by peer")))
    return EmailApiError(str(reply.get("error", "")), int(reply.get("status", 0) or 0))


async def send(
    nc: Any,
    subject: str,
    email: dict[str, Any],
    *,
    idempotency_key: str | None = None,
    correlation_id: str | None = None,
    timeout: float = 2.0,
) -> str:
    """Ask the provider to send one email; returns its message id or raises what the provider answered.

    With an idempotency key (the Idempotency-Key header) a repeat returns the first email's id, unsent;
    a correlation id goes in the Correlation-Id header, and the provider keeps it with what it sent.
    """
    headers = {KEY_HEADER: str(idempotency_key)} if idempotency_key else {}
    if correlation_id:
        headers[CORRELATION_HEADER] = str(correlation_id)
    body = json.dumps(email).encode()
    reply = json.loads((await nc.request(subject, body, timeout=timeout, headers=headers or None)).data)
    if "error" in reply:
        raise error_from_reply(reply)
    return str(reply["message_id"])


@dataclass
class Sent:
    """One email the provider sent."""

    message_id: str
    order_id: str | None
    to: str
    template: str
    ts: float
    correlation_id: str | None = None


@dataclass
class Request:
    """One send request as the provider saw it (status 200: sent)."""

    ts: float
    order_id: str | None
    to: str | None
    template: str | None
    status: int
    outcome: str
    correlation_id: str | None = None


class ProviderView:
    """Where a provider answers, how to control it, and read access to its store."""

    def __init__(self, db_path: str, prefix: str) -> None:
        self.db_path = db_path
        self.prefix = prefix

    @property
    def subject(self) -> str:
        """Where send requests go, e.g. 'provider.send'."""
        return f"{self.prefix}.send"

    @property
    def control_subject(self) -> str:
        return f"{self.prefix}.control"

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(self.db_path, timeout=10)
        try:
            db.execute("pragma busy_timeout=10000")
            return db.execute(sql, args).fetchall()
        finally:
            db.close()

    def sent(self, order_id: str | None = None) -> list[Sent]:
        """Every email sent (optionally for one order), oldest first."""
        sql = "select message_id, order_id, to_addr, template, ts, correlation_id from emails"
        args: tuple[Any, ...] = ()
        if order_id is not None:
            sql, args = sql + " where order_id = ?", (order_id,)
        return [Sent(*row) for row in self._read(sql + " order by ts", args)]

    def requests(self, order_id: str | None = None) -> list[Request]:
        """Every send request received (optionally for one order), oldest first."""
        sql = "select ts, order_id, to_addr, template, status, outcome, correlation_id from requests"
        args: tuple[Any, ...] = ()
        if order_id is not None:
            sql, args = sql + " where order_id = ?", (order_id,)
        return [Request(*row) for row in self._read(sql + " order by id", args)]

    async def control(self, nc: Any, op: str, **args: Any) -> dict[str, Any]:
        """Change what the provider does (see Behaviour.control); returns its state."""
        reply = await nc.request(self.control_subject, json.dumps({"op": op, **args}).encode(), timeout=2)
        answer: dict[str, Any] = json.loads(reply.data)
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer

    async def outage(self, nc: Any, seconds: float, *, from_next_request: bool = False) -> dict[str, Any]:
        """Take the provider down (every request: 503) for `seconds`, starting now or with the next request.

        From the next request: an outage a loaded machine cannot spend before anyone has tried.
        """
        return await self.control(nc, "outage", seconds=seconds, from_next_request=from_next_request)


class AttachedProvider(ProviderView):
    """A provider served on a connection of the caller's own; `behaviour` can be changed directly."""

    def __init__(self, db_path: str, prefix: str, behaviour: Behaviour, subs: list[Any]) -> None:
        super().__init__(db_path, prefix)
        self.behaviour = behaviour
        self.subs = subs

    async def stop(self) -> None:
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def attach(nc: Any, db_path: str, *, prefix: str = "provider") -> AttachedProvider:
    """Serve the provider on an existing connection, in this process, with its store at db_path."""
    behaviour = Behaviour()
    subs = await _subscribe(nc, ProviderStore(db_path), behaviour, prefix)
    return AttachedProvider(db_path, prefix, behaviour, subs)


class Provider(ProviderView):
    """A running provider process and read access to its store."""

    def __init__(self, proc: subprocess.Popen[bytes], db_path: str, prefix: str, url: str) -> None:
        super().__init__(db_path, prefix)
        self.proc = proc
        self.url = url
        self.own_folder: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, remove: bool = True) -> None:
        """Stop the process (SIGTERM, then SIGKILL); remove the store folder start() made, unless told not to."""
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

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"<email provider pid {self.pid} {state}: {self.subject}, store {self.db_path}>"


def start(url: str | None = None, *, prefix: str = "provider", ready_timeout: float = 10.0) -> Provider:
    """Start a provider process with a fresh store; return once it answers on NATS."""
    from msglab.broker.server import die_with_parent

    if url is None:
        from msglab.broker import server_url

        url = server_url()
    folder = tempfile.mkdtemp(prefix="msglab-provider-")
    db_path = os.path.join(folder, "provider.sqlite")
    open_sqlite(db_path, SCHEMA).close()
    args = [sys.executable, "-m", "msglab.world.email_provider", "--db", db_path, "--prefix", prefix]
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
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"the email provider process did not start (it said {line!r})")
    provider = Provider(proc, db_path, prefix, url)
    provider.own_folder = folder
    return provider


async def serve(url: str, db_path: str, prefix: str = "provider", ready: Any = None) -> None:
    """The provider process's life: connect, answer until cancelled."""
    import nats

    from msglab.broker import tls_options

    nc = await nats.connect(
        url, name="msglab-email-provider", max_reconnect_attempts=-1, reconnect_time_wait=0.2, **tls_options(url)
    )
    await _subscribe(nc, ProviderStore(db_path), Behaviour(), prefix)
    if ready is not None:
        ready()
    try:
        await asyncio.Event().wait()
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> None:
    """`python -m msglab.world.email_provider`: serve until SIGTERM, saying `ready` on stdout once subscribed."""
    parser = argparse.ArgumentParser(prog="python -m msglab.world.email_provider", description=__doc__)
    parser.add_argument("--url", help="NATS server URL (default: the first line of stdin)")
    parser.add_argument("--db", required=True, help="SQLite file for the provider's store")
    parser.add_argument("--prefix", default="provider", help="subjects <prefix>.send and <prefix>.control")
    args = parser.parse_args(argv)
    url = args.url or sys.stdin.readline().strip()

    def ready() -> None:
        print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        asyncio.run(serve(url, args.db, args.prefix, ready))


if __name__ == "__main__":
    main()
