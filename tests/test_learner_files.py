"""What the grader reads of a path learner code could write never blocks it or leads it elsewhere: a
FIFO, a symlink or a device is refused at once (open_learner_file), and a learner's SQLite database is
read from a snapshot in the grader's own folder (snapshot_sqlite), its WAL included."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from msglab.grading.effects import LearnerFileError, read_learner_file, snapshot_sqlite
from msglab.grading.harness import release_blocked_readers


def test_a_fifo_a_symlink_and_a_device_are_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "secret").write_text("the grader's")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for name in ("fifo", "link", "zero", "missing"):
        with pytest.raises(LearnerFileError):
            read_learner_file(str(tmp_path / name))  # returns at once: a blocking open would hang the test
    with pytest.raises(LearnerFileError):
        read_learner_file(str(tmp_path / "zero"), follow=True)  # followed, it is still no regular file
    assert read_learner_file(str(tmp_path / "secret")) == b"the grader's"
    with pytest.raises(LearnerFileError):
        read_learner_file(str(tmp_path / "secret"), limit=4)  # over the bound: refused, not cut


def test_a_learners_database_is_read_from_a_snapshot_with_its_wal(tmp_path: Path) -> None:
    learner, grader = tmp_path / "home", tmp_path / "private"
    learner.mkdir()
    grader.mkdir()
    db = sqlite3.connect(learner / "shop.sqlite", isolation_level=None)
    db.execute("pragma journal_mode=wal")
    db.execute("pragma wal_autocheckpoint=0")  # the rows stay in the WAL, as a killed worker leaves them
    db.execute("create table ledger (payment_id text)")
    db.executemany("insert into ledger values (?)", [("p-1",), ("p-2",), ("p-2",)])
    assert (learner / "shop.sqlite-wal").stat().st_size > 0
    copy = snapshot_sqlite(str(learner / "shop.sqlite"), str(grader))
    rows = sqlite3.connect(f"file:{copy}?mode=ro", uri=True).execute("select count(*) from ledger").fetchone()
    assert Path(copy).parent == grader and rows == (3,)
    db.close()


def test_a_grader_blocked_opening_a_fifo_is_released(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "shop.sqlite")
    opened: list[bytes] = []

    def read() -> None:
        with open(tmp_path / "shop.sqlite", "rb") as fifo:  # blocks in open(): no writer
            opened.append(fifo.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(200):  # until the reader waits in open() and the release reaches it
        release_blocked_readers(str(tmp_path))
        reader.join(0.05)
        if not reader.is_alive():
            break
    assert not reader.is_alive() and opened and set(opened[0]) <= {0}
