"""Module 07's shop: checkout's store with a transactional outbox, as a process opens it, and its counts.

One model for the lesson (msglab.demos.pipeline), the lab's playground and its grader. The relay that
publishes the outbox is msglab.world.relay.

    db = open_store(path)                  # WAL and a busy timeout; the tables made if missing
    outbox_id = place_order(db, order)     # the order and its outbox row, in one transaction
    counts(path)                           # Counts(orders, outbox, position), read-only

An order is a dict with `id`, `customer` and `cents`. The outbox row's id is what the relay sends as
`Nats-Msg-Id`: AUTOINCREMENT, so an id is never handed out twice even after rows are deleted (a plain
rowid reuses the highest one), and a resent row carries the id the stream already knows. The row's
`headers` (e.g. a `Correlation-Id` that checkout starts) are published with it as they are.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from msglab.world.payments import BUSY_MS, open_shop

ORDER_PLACED = "orders.placed"
CORRELATION_ID = "Correlation-Id"  # the header that names one order's path through every service
RELAY = "relay"  # the relay's name in the positions table (one row per relay)

SCHEMA = """
create table if not exists orders (id text primary key, customer text not null, cents integer not null);
create table if not exists outbox (
    id integer primary key autoincrement,
    order_id text not null,
    subject text not null,
    payload blob not null,
    headers text not null default '{}'
);
create table if not exists positions (relay text primary key, outbox_id integer not null);
"""
INSERT_ORDER = "insert into orders (id, customer, cents) values (:id, :customer, :cents)"
INSERT_OUTBOX = "insert into outbox (order_id, subject, payload, headers) values (:id, :subject, :payload, :headers)"


@dataclass(frozen=True)
class Row:
    """One outbox row: what the relay publishes, and the id it publishes it under."""

    id: int
    order_id: str
    subject: str
    payload: bytes
    headers: dict[str, str]


def open_store(path: str) -> sqlite3.Connection:
    """The shop's database as a process opens it (checkout, relay): WAL, waiting on locks, tables made."""
    db = open_shop(path)
    db.executescript(SCHEMA)
    return db


def event(order: dict[str, Any]) -> bytes:
    """The `orders.placed` event of an order: the order as JSON."""
    return json.dumps({"id": order["id"], "customer": order["customer"], "cents": order["cents"]}).encode()


def place_order(
    db: sqlite3.Connection, order: dict[str, Any], subject: str = ORDER_PLACED, headers: dict[str, str] | None = None
) -> int:
    """Write the order and its outbox row in one transaction; return the outbox id (both or neither commit)."""
    with db:
        db.execute(INSERT_ORDER, order)
        row = {"id": order["id"], "subject": subject, "payload": event(order), "headers": json.dumps(headers or {})}
        return int(db.execute(INSERT_OUTBOX, row).lastrowid or 0)


def position(db: sqlite3.Connection, relay: str = RELAY) -> int:
    """The last outbox id this relay saved as published (0: none yet)."""
    found = db.execute("select outbox_id from positions where relay = ?", (relay,)).fetchone()
    return int(found[0]) if found else 0


def save_position(db: sqlite3.Connection, outbox_id: int, relay: str = RELAY) -> None:
    """Record that the relay has the stream's ack for every row up to `outbox_id` (its own transaction)."""
    with db:
        db.execute(
            "insert into positions (relay, outbox_id) values (?, ?) "
            "on conflict (relay) do update set outbox_id = excluded.outbox_id",
            (relay, outbox_id),
        )


def pending(db: sqlite3.Connection, after: int, limit: int = 100) -> list[Row]:
    """Outbox rows after `after`, oldest first (at most `limit`)."""
    rows = db.execute(
        "select id, order_id, subject, payload, headers from outbox where id > ? order by id limit ?", (after, limit)
    )
    return [Row(int(i), str(o), str(s), bytes(p), json.loads(h)) for i, o, s, p, h in rows]


@dataclass(frozen=True)
class Counts:
    """What the store holds: committed orders, outbox rows, the relay's saved position, the highest outbox id."""

    orders: int
    outbox: int
    position: int
    last: int

    @property
    def unsent(self) -> int:
        """Outbox rows the relay has not saved as published yet."""
        return max(0, self.last - self.position)


def _read_only(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_MS / 1000)


def counts(path: str, relay: str = RELAY) -> Counts:
    """Count the store, read-only. Raises sqlite3.Error when there is no store (no file, no tables)."""
    db = _read_only(path)
    try:
        orders = int(db.execute("select count(*) from orders").fetchone()[0])
        outbox, last = db.execute("select count(*), coalesce(max(id), 0) from outbox").fetchone()
        return Counts(orders, int(outbox), position(db, relay), int(last))
    finally:
        db.close()


def order_ids(path: str) -> set[str]:
    """The ids of the committed orders, read-only."""
    db = _read_only(path)
    try:
        return {str(r[0]) for r in db.execute("select id from orders")}
    finally:
        db.close()
