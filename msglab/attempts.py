"""The learner's attempts: what each `msglab check` found, the hint levels it opened, progress, reset.

State lives in one JSON file in a local, git-ignored folder (`.msglab/` in the course root, or
MSGLAB_STATE_DIR), never beside the learner's files. Only `msglab check` of the learner's own file
records an attempt: `--solution` and direct calls to `grade()` (the test suite's) do not.

Hint levels (the lab pattern in msglab.grading): level 1 is the verdict itself; when the same check
fails in 2 attempts in a row, `msglab hint NN` shows level 2 (concept, lesson cell), after 3 level 3
(code); a pass of that check closes them again. Once the same check has failed 3 attempts in a
row, the verdict says where the reference solution is (not before: the learner should meet the
problem first, and three different mistakes fixed one by one are progress, not being stuck). A
lesson's demonstration check (`msglab.check(..., attempt=False)`) is no attempt at all.

(The module is not called `progress`: `msglab.progress()` is the notebook's function, and a
submodule of that name would replace it on the package the first time it is imported.)
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from msglab.catalog import Hint, Lab, all_labs, course_root, find_lab
from msglab.errors import LabError, MsglabError
from msglab.grading.verdict import Verdict

STATE_ENV = "MSGLAB_STATE_DIR"
SOLUTION_AFTER = 3  # failed attempts of one check in a row before its verdict says where the solution is
LABEL = 18  # width of "level 2, lesson" and its kin in `msglab hint`
LEVEL_NAMES = {2: "level 2 (the idea, and the lesson cell that shows it)", 3: "level 3 (code-level)"}


def state_dir() -> Path:
    """The folder for attempts and backups: MSGLAB_STATE_DIR, else `.msglab/` in the course root."""
    env = os.environ.get(STATE_ENV)
    return Path(env).resolve() if env else course_root() / ".msglab"


def state_file() -> Path:
    return state_dir() / "progress.json"


@dataclass
class FailedCheck:
    """A check that failed in the last attempt, with the verdict's own hint (level 1)."""

    name: str
    title: str
    hint: str = ""


@dataclass
class LabRecord:
    """Everything recorded about one lab's attempts."""

    attempts: int = 0
    failed_attempts: int = 0
    first_passed: str | None = None  # ISO time of the first pass
    first_passed_seed: int | None = None
    last_at: str | None = None
    last_seed: int | None = None
    last_passed: bool = False
    last_failed: list[FailedCheck] = field(default_factory=list)
    streaks: dict[str, int] = field(default_factory=dict)  # check id -> consecutive failed attempts

    @classmethod
    def from_dict(cls, data: Any) -> LabRecord:
        """Rebuild a record; raises TypeError or ValueError on anything that is not one."""
        fields = dict(data)
        fields["last_failed"] = [FailedCheck(**f) for f in fields.get("last_failed", [])]
        record = cls(**fields)
        if not isinstance(record.attempts, int) or not isinstance(record.streaks, dict):
            raise TypeError("attempts must be a number and streaks a table")
        return record

    def add(self, verdict: Verdict) -> None:
        """Count one graded attempt."""
        now = datetime.now().astimezone().isoformat(timespec="seconds")
        self.attempts += 1
        self.last_at, self.last_seed, self.last_passed = now, verdict.seed, verdict.passed
        self.last_failed = [FailedCheck(c.name, c.title, c.hint) for c in verdict.failures]
        # A check the run did not reach (the file did not import) keeps its streak: no new evidence.
        for check in verdict.checks:
            if check.passed:
                self.streaks.pop(check.name, None)
            else:
                self.streaks[check.name] = self.streaks.get(check.name, 0) + 1
        if not verdict.passed:
            self.failed_attempts += 1
        elif self.first_passed is None:
            self.first_passed, self.first_passed_seed = now, verdict.seed

    def stuck(self) -> bool:
        """Whether one check has failed SOLUTION_AFTER attempts in a row: then the solution is named."""
        return max(self.streaks.values(), default=0) >= SOLUTION_AFTER

    def level(self, check: str, hint: Hint | None) -> int:
        """The hint level open for `check`: 1 + one per repeated failure, capped by what lab.toml has."""
        return min(self.streaks.get(check, 0), 3, hint.top_level if hint else 1) or 1


# --- the state file: read under a lock, written atomically ------------------------------------


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise read-modify-write across processes (two checks at once lose no attempt)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no lock, but the atomic replace still keeps the file whole
        yield
        return
    with open(folder / "progress.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def write_atomically(path: Path, data: bytes) -> None:
    """Write a temporary file beside `path`, then rename it over: a reader sees old or new, never half."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o644)  # mkstemp's is 0o600
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)  # only still there if something failed before the rename


def _load() -> tuple[dict[str, LabRecord], str]:
    """All records, and a notice for the learner if a damaged file had to be moved aside."""
    path = state_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        raise MsglabError(f"cannot read {path}: {exc}", hint=f"check its permissions, or set {STATE_ENV}") from exc
    try:
        labs = json.loads(text)["labs"]
        return {name: LabRecord.from_dict(data) for name, data in labs.items()}, ""
    except (ValueError, TypeError, KeyError, AttributeError):
        aside = path.with_name(f"progress.json.damaged-{datetime.now():%Y%m%d-%H%M%S}")
        try:
            os.replace(path, aside)
        except OSError as exc:
            raise MsglabError(f"{path} is damaged and cannot be moved aside: {exc}", hint="delete it") from exc
        return {}, (
            f"your progress file {path} was damaged and could not be read; it is kept as {aside.name} in the "
            "same folder and progress starts afresh (your lab files are untouched)"
        )


def _save(records: dict[str, LabRecord]) -> None:
    data = {"version": 1, "labs": {name: asdict(record) for name, record in records.items()}}
    write_atomically(state_file(), (json.dumps(data, indent=1) + "\n").encode())


def read_records() -> tuple[dict[str, LabRecord], str]:
    """Every lab's record by lab name, and a notice if a damaged file was moved aside."""
    if not state_file().exists():
        return {}, ""  # reading must not create the state folder
    with _locked():
        return _load()


def record(verdict: Verdict) -> list[str]:
    """Count `verdict` as an attempt of the learner's file; return the lines to add to it."""
    lab = find_lab(verdict.lab)
    try:
        with _locked():
            records, notice = _load()
            entry = records.setdefault(lab.name, LabRecord())
            entry.add(verdict)
            _save(records)
    except OSError as exc:
        raise MsglabError(f"cannot write {state_file()}: {exc}", hint=f"check its folder, or set {STATE_ENV}") from exc
    notes = [notice] if notice else []
    return notes + next_steps(lab, entry, verdict)


# --- what the learner reads ----------------------------------------------------------------


def next_steps(lab: Lab, entry: LabRecord, verdict: Verdict) -> list[str]:
    """Lines for a failing verdict: which hint levels are open now, and (late) where the solution is."""
    if verdict.passed:
        return []
    lines = []
    failed = [(c.title, lab.hints.get(c.name), entry.level(c.name, lab.hints.get(c.name))) for c in verdict.failures]
    for level in (2, 3):
        titles = [title for title, _, opened in failed if opened == level]
        if titles:
            lines.append(f"`msglab hint {lab.number}` now shows {LEVEL_NAMES[level]} for: {'; '.join(titles)}")
    if not lines and any(hint and hint.top_level > opened for _, hint, opened in failed):
        lines.append(f"fail the same check again and `msglab hint {lab.number}` shows more about it")
    if entry.stuck():
        lines.append(solution_pointer(lab, entry))
    return lines


def solution_pointer(lab: Lab, entry: LabRecord) -> str:
    from msglab.classroom.edition import is_learner_edition

    if is_learner_edition() or not lab.source(solution=True).is_file():
        return (
            f"{entry.failed_attempts} failed attempts so far: `msglab hint {lab.number}` opens the next hint; "
            "your instructor has the reference solution"
        )
    where = lab.source(solution=True).relative_to(course_root()).as_posix()
    return (
        f"{entry.failed_attempts} failed attempts so far: the reference solution is {where} "
        f"(`msglab check {lab.number} --solution` shows it pass); compare it with yours, then close it"
    )


def _when(stamp: str | None) -> str:
    return datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M") if stamp else "-"


def hint_text(lab: Lab) -> str:
    """Every hint level open for the checks that failed in the last attempt of `lab`."""
    records, notice = read_records()
    entry = records.get(lab.name)
    lines = [notice] if notice else []
    if entry is None:
        lines.append(
            f"no attempt of lab {lab.number} is recorded yet: run `msglab check {lab.number}`; its verdict is "
            "the first hint for every check that fails"
        )
        return "\n".join(lines)
    last = f"your last attempt ({_when(entry.last_at)}, seed {entry.last_seed})"
    if entry.last_passed:
        return "\n".join([*lines, f"lab {lab.number}: {last} passed; no hints needed"])
    lines.append(f"lab {lab.number}: hints for the checks that failed in {last}")
    for failed in entry.last_failed:
        hint = lab.hints.get(failed.name)
        streak = entry.streaks.get(failed.name, 1)
        level = entry.level(failed.name, hint)
        times = {1: "once", 2: "twice in a row"}.get(streak, f"{streak} times in a row")
        lines += ["", f"FAIL {failed.title}  (failed {times})"]
        lines += _wrapped("level 1, verdict", failed.hint or "(the evidence in the verdict is the hint)")
        if hint and level >= 2:
            lines += _wrapped("level 2, idea", hint.concept) if hint.concept else []
            where = ", ".join(part for part in (lab.lesson, hint.lesson) if part)
            lines += _wrapped("level 2, lesson", where) if hint.lesson else []
        if hint and level >= 3:
            # Code keeps its own lines: wrapping it would change what it says.
            for i, line in enumerate(hint.code.splitlines()):
                lines.append(f"  {'' if i else 'level 3, code':<{LABEL}}{line}")
        top = hint.top_level if hint else 1
        if top == 1:
            lines.append("  (this lab has no further hints for this check)")
        elif level < top:
            lines.append(f"  level {level + 1} opens if this check fails again")
    lines += ["", f"the whole verdict again: msglab check {lab.number} --seed {entry.last_seed}"]
    if entry.stuck():
        lines.append(solution_pointer(lab, entry))
    return "\n".join(lines)


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, width=100, initial_indent=f"  {label:<{LABEL}}", subsequent_indent=" " * (LABEL + 2))


@dataclass
class ProgressRow:
    lab: Lab
    entry: LabRecord

    @property
    def status(self) -> str:
        if self.entry.first_passed:
            return "passed" if self.entry.last_passed else "passed (last check failed)"
        return "failing" if self.entry.attempts else "not tried"

    @property
    def first_pass(self) -> str:
        entry = self.entry
        return f"{_when(entry.first_passed)}, seed {entry.first_passed_seed}" if entry.first_passed else "-"


@dataclass
class Progress:
    """Every lab: passed or not, when it first passed and with which seed, attempts. Text or HTML."""

    rows: list[ProgressRow]
    where: Path
    notice: str = ""

    def to_text(self) -> str:
        width = max((len(row.lab.name) for row in self.rows), default=10)
        lines = [self.notice] if self.notice else []
        lines.append(f"{'lab':<{width}}  {'status':<26}  {'attempts':>8}  first passed")
        for row in self.rows:
            lines.append(f"{row.lab.name:<{width}}  {row.status:<26}  {row.entry.attempts:>8}  {row.first_pass}")
        lines.append(f"(kept in {self.where}; `msglab check NN` records an attempt)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td>{html.escape(row.lab.number)}</td><td>{html.escape(row.lab.title)}</td>"
            f"<td>{html.escape(row.status)}</td><td style='text-align:right'>{row.entry.attempts}</td>"
            f"<td>{html.escape(row.first_pass)}</td></tr>"
            for row in self.rows
        )
        notice = f"<div style='color:#9a6700'>{html.escape(self.notice)}</div>" if self.notice else ""
        return (
            f"<div class='msglab-progress'>{notice}<table><tr><th>lab</th><th>title</th><th>status</th>"
            f"<th>attempts</th><th>first passed</th></tr>{cells}</table></div>"
        )


def progress() -> Progress:
    """The progress of every lab of the course."""
    records, notice = read_records()
    rows = [ProgressRow(lab, records.get(lab.name, LabRecord())) for lab in all_labs()]
    return Progress(rows, state_file(), notice)


# --- reset ----------------------------------------------------------------------------------


@dataclass
class ResetOutcome:
    """What `reset` did: `restored` is False when the file already was the starter."""

    path: Path
    restored: bool
    backup: Path | None = None


def committed_starter(lab: Lab) -> bytes:
    """The lab file as committed in the course's git checkout (HEAD), or LabError saying why not."""
    root = course_root()
    relative = (lab.folder / lab.file).relative_to(root).as_posix()
    try:  # "./" makes the path relative to the course root even inside a larger repository
        done = subprocess.run(["git", "show", f"HEAD:./{relative}"], cwd=root, capture_output=True)
    except FileNotFoundError as exc:
        raise LabError("`msglab reset` restores the starter from git, and git is not installed") from exc
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip()
        if "not a git repository" in said:
            raise LabError(
                f"cannot reset lab {lab.number}: the course at {root} is not a git checkout, so there is no "
                "committed starter to restore",
                hint=f"copy {relative} from a fresh download of the course",
            )
        raise LabError(f"cannot reset lab {lab.number}: git has no committed {relative}: {said}")
    return done.stdout


def reset_lab(lab: Lab) -> ResetOutcome:
    """Back up the learner's file into the state folder, then restore the committed starter."""
    path = lab.folder / lab.file
    starter = committed_starter(lab)
    current = path.read_bytes() if path.is_file() else None
    if current == starter:
        return ResetOutcome(path, restored=False)
    backup = None
    if current is not None:
        folder = state_dir() / "backups" / lab.name
        folder.mkdir(parents=True, exist_ok=True)
        stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
        backup = folder / f"{stamp}-{path.name}"
        for n in range(2, 100):  # two resets in one second keep both backups
            if not backup.exists():
                break
            backup = folder / f"{stamp}-{n}-{path.name}"
        shutil.copy2(path, backup)
    write_atomically(path, starter)
    return ResetOutcome(path, restored=True, backup=backup)
