"""Fault injection, kept apart from checking (as Maelstrom keeps its nemesis apart).

The grader draws a fault plan from a seed and keeps it: the learner's process never sees it.
A plan names an effect and the number of its call in one process (`Crash("send_email", 3,
"before")`). When that call reaches the grader over the child's effect channel, the grader
SIGKILLs the child's whole process group before recording the effect ("before") or right after
("after"), and logs the crash: no cleanup runs, no buffer is flushed, no ack is sent, exactly
like a machine losing power. Because the grader pulls the trigger itself, it knows which
planned faults fired; a run whose faults did not fire cannot pass (see msglab.grading).

A seed is public (it is printed with every verdict), and this module's code is importable by
learner code, so a plan drawn from the seed alone could be rebuilt by the learner's process. A run
draws its plan from `plan_seed(seed)` instead: an HMAC of the seed under a key of this installation
(`plan_key`: the file var/plan.key, readable only by the grader's user and made on first use, or the
text in $MSGLAB_PLAN_KEY, which a class gradebook and the test suite set and no learner process
inherits). The same seed under the same key gives the same plan, so replays reproduce; under another
key, another plan.

What holds: when the grader is root, learner code runs as a user of its own and cannot read the
key (nor the grader's memory or environment: learner processes are forks of a nursery that never
loads it, with allow-listed environments). When the grader is not root, learner code runs as the
grader's own user and could read the key: self-study trusts the learner with their own grading.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

WHEN = ("before", "after")  # before the effect is recorded, or after it


@dataclass(frozen=True)
class Crash:
    """Crash on the `call`-th call (1-based, counted per process) of effect `effect`, `when` it is taken."""

    effect: str
    call: int
    when: str = "before"
    # The lab's words for this crash, used by rules.faults_check when it did not fire (rule 1):
    point: str = ""  # where it kills, e.g. "right after the invoice went out, on the invoice it sent #2"
    counted: str = ""  # what the call counts, singular, e.g. "invoice" ("made only 1 invoice")
    hint: str = ""  # what the learner's code must do for this crash to be reachable

    def describe(self) -> str:
        return f"SIGKILL {self.when} {self.effect} call #{self.call}"


def rng(seed: int, stream: str) -> random.Random:
    """An independent random stream per purpose, so adding one draw never shifts another."""
    return random.Random(f"{seed}:{stream}")


KEY_BYTES = 32
# The plan key as text, read before var/plan.key (class gradebooks, the test suite). Not on the sandbox's
# allow-list (sandbox.LEARNER_ENV), so no learner process is started with it.
KEY_VARIABLE = "MSGLAB_PLAN_KEY"


def key_file() -> Path:
    """Where this installation's plan key lives: var/plan.key in the course root (not in git)."""
    from msglab.catalog import course_root

    return course_root() / "var" / "plan.key"


_keys: dict[Path, bytes] = {}  # this process's keys by file, once read


def plan_key(path: Path | None = None) -> bytes:
    """This installation's secret for fault plans: from $MSGLAB_PLAN_KEY when set, else read from
    `key_file()`, made on first use (0600, the grader's user). A file that is not the grader's own (a
    symlink, another user's, readable by others, the wrong size: planted or damaged) is replaced, never used.
    """
    text = os.environ.get(KEY_VARIABLE, "") if path is None else ""
    if text:
        return key_from_text(text)
    path = path or key_file()
    if path in _keys:
        return _keys[path]
    path.parent.mkdir(parents=True, exist_ok=True)
    key = read_key(path)
    for _attempt in range(3):
        if key is not None:
            break
        with contextlib.suppress(FileNotFoundError):
            if os.path.lexists(path):
                os.unlink(path)  # not ours, or not a key: it must never decide a plan
        _make_key(path)
        key = read_key(path)
    if key is None:
        raise PermissionError(f"{path}: no usable fault-plan key (it keeps being replaced)")
    _keys[path] = key
    return key


def key_from_text(text: str) -> bytes:
    """The plan key a text names ($MSGLAB_PLAN_KEY): any text, the same key wherever it is set."""
    return hashlib.sha256(f"msglab-plan-key:{text}".encode()).digest()


def key_id(key: bytes) -> str:
    """A name for a key that gives nothing of it away: what a class's grading.json records."""
    return hashlib.sha256(b"msglab-plan-key-id:" + key).hexdigest()[:12]


def read_key(path: Path) -> bytes | None:
    """The key in `path`, or None unless it is a regular file of KEY_BYTES bytes, ours, that nobody else reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # a symlink (ELOOP) or worse
        return None
    try:
        info = os.fstat(fd)
        ours = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
        data = os.read(fd, KEY_BYTES + 1) if ours else b""
    finally:
        os.close(fd)
    return data if len(data) == KEY_BYTES else None


def _make_key(path: Path) -> None:
    """Write a fresh key whole, then link it into place: a reader never sees half a key, and of two
    processes making one at once, the first link wins and the other reads it."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)


def plan_seed(seed: int, key: bytes | None = None) -> int:
    """The seed a run draws its fault plan from: the public seed under the plan key (this installation's)."""
    digest = hmac.new(key or plan_key(), f"msglab-plan:{seed}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")
