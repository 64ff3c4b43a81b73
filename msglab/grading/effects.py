"""The effect log: what learner code did to the outside world, as the grader saw it happen.

Every effect (an email sent, a card charged), every injected crash and every note is one
`Event`, recorded in the grader's own process the moment the request reaches it over the
child's private effect channel. Learner code can ask for an effect (that is doing it), never
write, edit or delete a record. Graders judge these events, never printed text.
`open_sqlite` is the one SQLite opener the course's own stores share.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any


def open_sqlite(path: str, schema: str) -> sqlite3.Connection:
    """A connection in autocommit mode (WAL) that waits for other writers instead of failing."""
    db = sqlite3.connect(path, timeout=10, isolation_level=None)
    db.execute("pragma journal_mode=wal")
    db.execute("pragma busy_timeout=10000")
    db.executescript(schema)
    return db


@dataclass
class Event:
    """One thing that happened: kind 'effect', 'crash' or 'note', by name, for a business key."""

    id: int
    ts: float  # the grader's clock (time.time()) when the grader saw it
    pid: int
    role: str
    kind: str
    name: str
    key: str | None
    detail: dict[str, Any] = field(default_factory=dict)


class EffectLog:
    """Append-only, in the grader's memory: the learner's processes cannot reach it."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._ids = itertools.count(1)

    def record(
        self, kind: str, name: str, key: str | None = None, *, pid: int = 0, role: str = "grader", **detail: Any
    ) -> Event:
        """Append one event, stamped with the grader's clock; returns it."""
        event = Event(next(self._ids), time.time(), pid, role, kind, name, key, detail)
        self._events.append(event)
        return event

    def events(self, kind: str | None = None, name: str | None = None) -> list[Event]:
        """All events, oldest first, optionally filtered."""
        return [e for e in self._events if (kind is None or e.kind == kind) and (name is None or e.name == name)]

    def count(self, kind: str, name: str) -> int:
        """How many events of this kind and name."""
        return sum(1 for e in self._events if e.kind == kind and e.name == name)
