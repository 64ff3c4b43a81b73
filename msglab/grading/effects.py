"""The effect log: what learner code did to the outside world, as the grader saw it happen.

Every effect (an email sent, a card charged), every injected crash and every note is one
`Event`, recorded in the grader's own process the moment the request reaches it over the
child's private effect channel. Learner code can ask for an effect (that is doing it), never
write, edit or delete a record. Graders judge these events, never printed text.
`open_sqlite` is the one SQLite opener the course's own stores share. A file learner code could
have written (anything under the run's home) is read only through `read_learner_file` or
`snapshot_sqlite`: never through a symlink, never blocking on a FIFO, bounded in size.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from typing import Any


class LearnerFileError(OSError):
    """A file the learner's processes could write is not a regular file the grader can read safely."""


LEARNER_FILE_LIMIT = 64 << 20  # the most the grader reads of one learner-writable file (its file size limit)


def open_learner_file(path: str, *, follow: bool = False, limit: int = LEARNER_FILE_LIMIT) -> int:
    """Open a path learner code could have written, for reading, without ever blocking on it: not through
    a symlink (unless `follow`), never a FIFO, socket or device (O_NONBLOCK, then a regular-file check on
    what was opened), at most `limit` bytes. Returns the file descriptor; raises LearnerFileError.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise LearnerFileError(exc.errno, f"{path} cannot be opened: {exc.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"over {limit >> 20} MB"
        raise LearnerFileError(0, f"{path} is {what}")
    return fd


def read_learner_file(path: str, *, follow: bool = False, limit: int = LEARNER_FILE_LIMIT) -> bytes:
    """The bytes of a learner-writable file, read as `open_learner_file` opens it (never blocks)."""
    fd = open_learner_file(path, follow=follow, limit=limit)
    try:
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def snapshot_sqlite(path: str, folder: str) -> str:
    """Copy a learner-writable SQLite database (and its -wal, if any) into `folder` (the grader's own) and
    return the copy's path: the grader opens the copy, so a FIFO, a symlink or a file swapped mid-read
    in the learner's folder can neither block nor redirect it. Raises LearnerFileError.
    """
    target = os.path.join(folder, os.path.basename(path))
    for suffix in ("", "-wal"):
        if suffix and not os.path.lexists(path + suffix):
            continue
        data = read_learner_file(path + suffix)
        with open(target + suffix, "wb") as out:
            out.write(data)
    return target


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
