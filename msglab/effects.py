"""The effect store: what learner code did to the outside world, written so a SIGKILL cannot lie.

Every effect (an email sent, a card charged) and every injected crash is one row, committed
before the call returns, in a SQLite file the grader reads after the run. Graders judge these
rows (lost, applied twice, reordered), never printed text.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

SCHEMA = """
create table if not exists events (
    id integer primary key autoincrement,
    ts real not null,
    pid integer not null,
    role text not null,
    kind text not null,      -- 'effect', 'crash', 'note'
    name text not null,      -- e.g. 'send_email'
    key text,                -- the business key, e.g. an order id
    detail text              -- JSON
);
"""


def open_sqlite(path: str, schema: str) -> sqlite3.Connection:
    """A connection in autocommit mode (WAL) that waits for other writers instead of failing."""
    db = sqlite3.connect(path, timeout=10, isolation_level=None)
    db.execute("pragma journal_mode=wal")
    db.execute("pragma busy_timeout=10000")
    db.executescript(schema)
    return db


def open_db(path: str) -> sqlite3.Connection:
    """The effect store."""
    return open_sqlite(path, SCHEMA)


@dataclass
class Event:
    """One row of the store."""

    id: int
    ts: float
    pid: int
    role: str
    kind: str
    name: str
    key: str | None
    detail: dict[str, Any]


class EffectLog:
    """Append-only log of effects and crashes, shared by the grader and its child processes."""

    def __init__(self, path: str, role: str = "grader") -> None:
        self.path = path
        self.role = role
        self.db = open_db(path)

    def record(self, kind: str, name: str, key: str | None = None, **detail: Any) -> None:
        """Commit one row now (autocommit): it survives a SIGKILL that follows."""
        self.db.execute(
            "insert into events (ts, pid, role, kind, name, key, detail) values (?, ?, ?, ?, ?, ?, ?)",
            (time.time(), os.getpid(), self.role, kind, name, key, json.dumps(detail)),
        )

    def events(self, kind: str | None = None, name: str | None = None) -> list[Event]:
        """All rows, oldest first, optionally filtered."""
        sql, args = "select * from events", []
        where = []
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if name:
            where.append("name = ?")
            args.append(name)
        if where:
            sql += " where " + " and ".join(where)
        rows = self.db.execute(sql + " order by id", args).fetchall()
        return [
            Event(row[0], row[1], row[2], row[3], row[4], row[5], row[6], json.loads(row[7] or "{}")) for row in rows
        ]

    def count(self, kind: str, name: str) -> int:
        """How many rows of this kind and name (cheap enough to poll while waiting)."""
        return int(
            self.db.execute("select count(*) from events where kind = ? and name = ?", (kind, name)).fetchone()[0]
        )

    def close(self) -> None:
        self.db.close()
