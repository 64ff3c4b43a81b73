"""The known files of every lab and the verdict each must get: starter, solution, and variants.

A variant's docstring says what it expects, on a line of its own:
    Expect: fail no_lost_emails, all_acked     (these checks must be among the failures)
    Expect: fail a|b                           (at least one of them: the same mistake shows as
                                                either, depending on the run's timing)
    Expect: pass                               (under also_right/: a correct file written differently)

and, on lines of their own, what its verdict must say (so no test grades the file again to read it):
    Says: temporal coupling                    (in Verdict.to_text(), any case, on every seed)
    Says: dropped | reached the stream later   (at least one of them)
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from conftest import VERDICT_LOG
from msglab.catalog import all_labs
from msglab.classroom.points import lab_points
from msglab.grading.verdict import Verdict

T = TypeVar("T")
VARIANTS = Path(__file__).resolve().parent / "variants"
EXPECT = re.compile(r"^[ \t]*Expect:[ \t]*(pass|fail)\b[ \t]*(.*)$", re.M)
SAYS = re.compile(r"^[ \t]*Says:[ \t]*(.*?)[ \t]*$", re.M)
LOAD_SEED = 11  # every file's fifth seed, graded with every core busy (tests/test_variants_under_load.py)

# How much of the known files' seeds and plans a run of the suite covers. `quick` (what `make test`
# runs): each file on one of its four seeds, a share of the files under load and of the hostile corpus,
# chosen by the round; `deep` (`make test DEPTH=deep`): every seed, every file under load,
# every hostile case. A round is the commit checked out, so a rerun on the same commit grades the same
# plans (a failure replays) and every commit turns to other seeds; MSGLAB_TEST_ROUND picks one.
DEPTH = os.environ.get("MSGLAB_TEST_DEPTH", "quick")
if DEPTH not in ("quick", "deep"):
    raise ValueError(f"MSGLAB_TEST_DEPTH={DEPTH!r}: 'quick' (the default) or 'deep'")


def _round() -> int:
    if os.environ.get("MSGLAB_TEST_ROUND"):
        return int(os.environ["MSGLAB_TEST_ROUND"])
    head = Path(__file__).resolve().parent.parent / ".git"
    try:
        ref = (head / "HEAD").read_text().strip()
        if ref.startswith("ref: "):
            ref = (head / ref[5:]).read_text().strip() if (head / ref[5:]).is_file() else _packed(head, ref[5:])
        return int(ref[:8], 16)
    except (OSError, ValueError):  # not a git checkout (an unpacked tarball): always the first round
        return 0


def _packed(git: Path, ref: str) -> str:
    for line in (git / "packed-refs").read_text().splitlines():
        if line.endswith(" " + ref):
            return line.split()[0]
    raise ValueError(ref)


ROUND = _round()


def _spread(name: str) -> int:
    return zlib.crc32(name.encode())


def in_this_round(name: str, share: int) -> bool:
    """Whether the item called `name` is graded in this run: always in a deep run; in a quick one, for
    one round in `share` (items spread over the rounds by their names, so a run holds about 1/share)."""
    return DEPTH == "deep" or (_spread(name) + ROUND) % share == 0


def this_round(items: list[T], share: int, name: Callable[[T], str] = str) -> list[T]:
    """The items graded in this run: all in a deep run; in a quick one, one in `share` of them (as many each
    round, give or take one: a round's cost does not depend on its luck), spread by their names, the next
    share each round so that `share` rounds cover them all; never none of a non-empty list."""
    if DEPTH == "deep" or not items:
        return list(items)
    spread = sorted(range(len(items)), key=lambda i: (_spread(name(items[i])), name(items[i])))
    kept = sorted(spread[ROUND % share :: share]) or spread[ROUND % len(items) :][:1]
    return [items[i] for i in kept]


def one_this_round(items: list[T], count: int = 1) -> list[T]:
    """Every item in a deep run; in a quick one, exactly `count` (spread evenly), the next ones each round."""
    if DEPTH == "deep":
        return list(items)
    return [items[(ROUND + k * len(items) // count) % len(items)] for k in range(min(count, len(items)))]


@dataclass(frozen=True)
class Case:
    """One file of one lab and the verdict it must get."""

    lab: str  # the lab number
    name: str  # starter, solution, or the variant's path under its lab folder
    path: Path
    passes: bool
    checks: frozenset[str] = frozenset()  # for a failing file: checks that must be among the failures
    says: tuple[tuple[str, ...], ...] = ()  # texts the verdict must contain: one of each tuple
    teaches: bool = False  # every failure carries its evidence and a hint (the starter's first verdict)
    hinted: frozenset[str] = frozenset()  # check ids with hints (lab.toml's or the platform's); empty: not judged
    scored: frozenset[str] = frozenset()  # check ids a class's gradebook gives points (lab.toml); empty: not judged

    @property
    def id(self) -> str:
        return f"{self.lab}-{self.name}"

    @property
    def own_seeds(self) -> list[int]:
        """Four seeds of the file's own, from where its name says, never LOAD_SEED: with it, five seeds
        (rule 9); each file meets other plans, so the suite covers a few hundred, and any failure names
        its seed for a replay."""
        first = 1 + zlib.crc32(self.id.encode()) % 200
        return [seed for seed in range(first, first + 5) if seed != LOAD_SEED][:4]

    @property
    def seeds(self) -> list[int]:
        """The seeds this run grades the file on: all four in a deep run, one a round in a quick one
        (each round the next, so four rounds cover them)."""
        own = self.own_seeds
        return own if DEPTH == "deep" else [own[(_spread(self.id) + ROUND) % len(own)]]

    def judge(self, verdict: Verdict) -> str:
        """An empty string when the verdict is the expected one, else what is wrong with it."""
        failed = {check.name for check in verdict.failures}
        if self.passes and not verdict.passed:
            return f"{self.id} must pass, failed {sorted(failed)}:\n{verdict.to_text()}"
        if not self.passes and verdict.passed:
            return f"{self.id} must fail, but passed:\n{verdict.to_text()}"
        if not all(failed & set(group.split("|")) for group in self.checks):
            return f"{self.id} must fail {sorted(self.checks)}; failed {sorted(failed)}:\n{verdict.to_text()}"
        text = verdict.to_text().lower()
        missing = [" | ".join(words) for words in self.says if not any(w.lower() in text for w in words)]
        if missing:
            return f"{self.id} must say {missing}:\n{verdict.to_text()}"
        if self.teaches and not all(c.message and c.hint for c in verdict.failures):
            mute = [c.name for c in verdict.failures if not (c.message and c.hint)]
            return f"{self.id}: every failure teaches, evidence and a hint; {mute} do not:\n{verdict.to_text()}"
        unhinted = {c.name for c in verdict.checks} - self.hinted if self.hinted else set()
        if unhinted:
            return f"{self.id}: checks without [hints.<id>] in lab.toml or the platform's: {sorted(unhinted)}"
        unscored = {c.name for c in verdict.checks} - self.scored if self.scored else set()
        if unscored:  # msglab grade would score every verdict of the lab as a grader error
            return (
                f"{self.id}: checks without points (a [hints.<id>] or [points] entry in lab.toml): {sorted(unscored)}"
            )
        return ""


def expectation(path: Path) -> tuple[bool, frozenset[str]]:
    """Read a variant's Expect line; a file without one is a test-suite error."""
    match = EXPECT.search(path.read_text())
    if not match:
        raise ValueError(f"{path} has no 'Expect: pass' or 'Expect: fail <check>' line in its docstring")
    checks = frozenset(c.strip() for c in match.group(2).split(",") if c.strip())
    return match.group(1) == "pass", checks


def sayings(path: Path) -> tuple[tuple[str, ...], ...]:
    """Read a variant's Says lines: each a tuple of alternatives, of which the verdict must contain one."""
    found = tuple(tuple(w.strip() for w in line.split(" | ") if w.strip()) for line in SAYS.findall(path.read_text()))
    if not all(found):
        raise ValueError(f"{path} has an empty 'Says:' line")
    return found


def all_cases() -> list[Case]:
    """Starter (fails, and teaches), solution (passes, every check it reports has hints) and every
    variant, for every lab."""
    cases = []
    for lab in all_labs():
        cases.append(Case(lab.number, "starter", lab.source(solution=False), passes=False, teaches=True))
        scored = frozenset(lab_points(lab).points)
        cases.append(Case(lab.number, "solution", lab.source(solution=True), passes=True, hinted=frozenset(lab.hints),
                          scored=scored))  # fmt: skip
        folder = VARIANTS / lab.name
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            passes, checks = expectation(path)
            name = str(path.relative_to(folder).with_suffix(""))
            cases.append(Case(lab.number, name, path, passes, checks, sayings(path)))
    return cases


# Verdicts graded at once by tests/test_variants.py across all of the session's workers: four per core,
# what four workers grading two seeds each reached on two cores before (five seeds at once starved lab
# 05's age judgments of CPU). A test grades its four seeds at once when the slots are free, so the
# files graded while other workers run notebooks or the browser are not held to two at a time.
SLOTS = 4 * (os.cpu_count() or 1)


@contextmanager
def verdict_slot() -> Iterator[None]:
    """Hold one of the session's SLOTS while grading (a lock file each, in the folder conftest.py
    made for the run); outside a test session, no limit."""
    folder = os.environ.get(VERDICT_LOG)
    if not folder:
        yield
        return
    slots = Path(folder) / "slots"
    slots.mkdir(exist_ok=True)
    held = None
    for slot in range(SLOTS):
        fd = os.open(slots / str(slot), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        held = fd
        break
    if held is None:  # every slot busy: wait for one (each thread its own, so waiters spread out)
        held = os.open(slots / str(threading.get_ident() % SLOTS), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(held, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(held)  # closing the descriptor releases its lock
