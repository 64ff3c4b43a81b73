"""The payments shop of lesson 03 and its lab: its database as a worker opens it, and its ledger counted.

One model for the lesson's bench (msglab.demos.idempotency), the lab's playground and its grader
(msglab.graders.idempotency). Its payment gateway is msglab.world.gateway.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable
from typing import Any

BUSY_MS = 10_000  # how long a worker waits for another worker's write lock before SQLite gives up


def open_shop(path: str, factory: Any = sqlite3.Connection) -> sqlite3.Connection:
    """The shop's database as a worker opens it: WAL and a busy timeout, so two workers writing at once
    wait for each other instead of failing (`factory`: a sqlite3.Connection subclass, e.g. the grader's)."""
    db = sqlite3.connect(path, timeout=BUSY_MS / 1000, factory=factory)
    db.execute("pragma journal_mode=wal")
    db.execute(f"pragma busy_timeout={BUSY_MS}")
    return db


def ledger_counts(path: str, ids: Iterable[str] | None = None) -> Counter[str]:
    """Rows per payment in the shop's `ledger` table (only `ids`, when given), read-only.

    Raises sqlite3.Error when there is no ledger to read (no table, no file).
    """
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_MS / 1000)
    try:
        rows = Counter(str(r[0]) for r in db.execute("select payment_id from ledger"))
    finally:
        db.close()
    if ids is None:
        return rows
    return Counter({pid: rows[pid] for pid in ids if rows[pid]})
