"""A class's submissions: which file each learner handed in for each lab.

SUBMISSIONS is a folder with one folder per learner, or a zip holding the same (as a course
platform exports it). Inside a learner's folder, a lab's file is found by its name (lab.toml's
`file`), in any of these layouts:

    alice/labs/01_request_reply_vs_events/orders.py   the course's own layout (a whole copy of the course)
    alice/01_request_reply_vs_events/orders.py        lab folders only (also `01/` or the topic name)
    alice/orders.py                                   just the edited files (when no two labs share a name)

Platform exports understood: a zip whose learner folders sit in one wrapper folder (it is
skipped), Moodle's `Full Name_123_assignsubmission_file_/` folders (the suffix is dropped), and
Canvas's flat `name_LATE_123_456_orders-1.py` files (learner `name_123`).

Only the lab files are read, nothing else: no file is extracted, links are never followed
(a link is reported, not graded), and a lab file over MAX_BYTES is not read.
"""

from __future__ import annotations

import os
import re
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from msglab.catalog import Lab
from msglab.errors import MsglabError

MAX_BYTES = 1 << 20  # a lab file larger than this is not a lab file
MAX_FILES = 20_000  # entries looked at per learner: a submission that holds a whole disk is cut short
# Never a learner's lab file: platform debris, environments, and a whole course copy's answers and tests.
SKIP_DIRS = {"__MACOSX", "__pycache__", ".ipynb_checkpoints", ".git", ".venv", "venv", "site-packages", "node_modules",
             "solutions", "tests"}  # fmt: skip
_MOODLE = re.compile(r"^(?P<learner>.+?)_assignsubmission_[a-z]+_?$")
_CANVAS = re.compile(r"^(?P<name>[A-Za-z0-9-]+?)(?:_late)?_(?P<uid>\d+)_(?P<sub>\d+)_(?P<file>.+)$", re.I)
_RESUBMITTED = re.compile(r"^(?P<stem>.+?)-\d+(?P<suffix>\.[^.]+)$")  # Canvas renames orders.py to orders-1.py


class SubmissionsError(MsglabError):
    """The submissions cannot be read at all (not a folder, not a zip)."""


@dataclass
class Entry:
    """One file of a learner's submission, read only when asked."""

    path: PurePosixPath  # inside the learner's folder
    size: int
    link: bool
    read: Callable[[], bytes]


@dataclass
class Found:
    """A learner's file for one lab, or why there is none."""

    learner: str
    lab: Lab
    content: bytes | None
    where: str  # where it was found, for the gradebook and the feedback
    problem: str = ""  # set when content is None


@dataclass
class Submissions:
    """Every learner's entries, by learner id, and notes on what was skipped."""

    source: str
    learners: dict[str, list[Entry]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def find(self, learner: str, lab: Lab, labs: list[Lab]) -> Found:
        """The learner's file for `lab` (`labs`: every lab of the course, to know which names are unique)."""
        return find_lab_file(learner, self.learners.get(learner, []), lab, labs)


def read_submissions(path: Path) -> Submissions:
    """Read a submissions folder or zip (see the module docstring)."""
    if path.is_dir():
        return _from_folder(path)
    if path.is_file() and zipfile.is_zipfile(path):
        return _from_zip(path)
    if not path.exists():
        raise SubmissionsError(f"{path} does not exist", hint="give the folder (one folder per learner) or a zip")
    raise SubmissionsError(f"{path} is neither a folder nor a zip file", hint="give the folder or the platform's zip")


def _learner_id(name: str) -> str:
    match = _MOODLE.match(name)
    return match.group("learner") if match else name


def _from_folder(root: Path) -> Submissions:
    found = Submissions(str(root))
    for item in sorted(os.scandir(root), key=lambda e: e.name):
        if item.name.startswith(".") or item.name in SKIP_DIRS:
            continue
        if item.is_symlink():
            found.notes.append(f"{item.name}: a symbolic link, skipped (links are never followed)")
        elif item.is_dir(follow_symlinks=False):
            found.learners.setdefault(_learner_id(item.name), []).extend(walk(Path(item.path)))
        elif (canvas := _CANVAS.match(item.name)) and item.is_file(follow_symlinks=False):
            entry = Entry(PurePosixPath(_original_name(canvas.group("file"))), item.stat().st_size, False,
                          _file_reader(Path(item.path)))  # fmt: skip
            found.learners.setdefault(f"{canvas.group('name')}_{canvas.group('uid')}", []).append(entry)
        else:
            found.notes.append(f"{item.name}: not a learner's folder, skipped")
    return found


def walk(folder: Path) -> list[Entry]:
    entries: list[Entry] = []
    for here, dirs, files in os.walk(folder):  # never follows links to folders
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for name in sorted(files):
            path = Path(here) / name
            info = path.lstat()
            relative = PurePosixPath(path.relative_to(folder).as_posix())
            entries.append(Entry(relative, info.st_size, stat.S_ISLNK(info.st_mode), _file_reader(path)))
            if len(entries) >= MAX_FILES:
                return entries
    return entries


def _file_reader(path: Path) -> Callable[[], bytes]:
    def read() -> bytes:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a link swapped in now is refused too
        with os.fdopen(fd, "rb") as handle:
            return handle.read(MAX_BYTES + 1)

    return read


def _from_zip(path: Path) -> Submissions:
    found = Submissions(str(path))
    archive = zipfile.ZipFile(path)
    members = []
    for info in archive.infolist():
        parts = PurePosixPath(info.filename.replace("\\", "/")).parts
        if info.is_dir() or not parts or any(p in ("..", "") or p.startswith(".") or p in SKIP_DIRS for p in parts):
            continue
        members.append((parts, info))
    # Wrapper folders (an export's top folder) hold learner folders and platform files, never a
    # lab's file or folder: a single top folder holding one of those is a learner's, not a wrapper.
    while members and len({parts[0] for parts, _ in members}) == 1 and all(len(parts) > 1 for parts, _ in members):
        inside = [parts[1:] for parts, _ in members]
        if any(_looks_like_lab_folder(rest[0]) if len(rest) > 1 else not _CANVAS.match(rest[0]) for rest in inside):
            break
        members = [(parts[1:], info) for parts, info in members]

    def reader(info: zipfile.ZipInfo) -> Callable[[], bytes]:
        def read() -> bytes:
            with archive.open(info) as handle:  # never extracted: read at most MAX_BYTES + 1
                return handle.read(MAX_BYTES + 1)

        return read

    for parts, info in members:
        link = stat.S_ISLNK(info.external_attr >> 16)
        if len(parts) == 1:
            canvas = _CANVAS.match(parts[0])
            if not canvas:
                found.notes.append(f"{parts[0]}: a file outside any learner's folder, skipped")
                continue
            learner = f"{canvas.group('name')}_{canvas.group('uid')}"
            relative: tuple[str, ...] = (_original_name(canvas.group("file")),)
        else:
            learner, relative = _learner_id(parts[0]), parts[1:]
        entries = found.learners.setdefault(learner, [])
        if len(entries) < MAX_FILES:
            entries.append(Entry(PurePosixPath(*relative), info.file_size, link, reader(info)))
    return found


def _original_name(name: str) -> str:
    match = _RESUBMITTED.match(name)
    return f"{match.group('stem')}{match.group('suffix')}" if match else name


def _looks_like_lab_folder(name: str) -> bool:
    return name in ("labs", "lessons") or bool(re.match(r"^\d\d(_|$)", name))


def _rank(path: PurePosixPath, lab: Lab) -> int | None:
    """How surely `path` is the learner's file for `lab`: 0 best; None if it is not."""
    if path.name != lab.file:
        return None
    parent = path.parent.name
    if parent == lab.name and path.parent.parent.name == "labs":
        return 0
    if parent == lab.name:
        return 1
    if parent in (lab.number, lab.topic, f"lab{lab.number}", f"lab_{lab.number}", f"lab-{lab.number}"):
        return 2
    if len(path.parts) == 1:
        return 3
    return 4


def find_lab_file(learner: str, entries: list[Entry], lab: Lab, labs: list[Lab]) -> Found:
    """Pick the learner's file for one lab among their entries (see the module docstring)."""
    shared = sum(other.file == lab.file for other in labs) > 1  # then a bare file name cannot say which lab
    ranked = [(rank, entry) for entry in entries if (rank := _rank(entry.path, lab)) is not None]
    if shared:
        ranked = [(rank, entry) for rank, entry in ranked if rank <= 2]
    if not ranked:
        where = f"{lab.name}/{lab.file}" if shared else lab.file
        return Found(learner, lab, None, "", f"missing: no {where} in the submission")
    best = min(rank for rank, _ in ranked)
    candidates = sorted((e for rank, e in ranked if rank == best), key=lambda e: (len(e.path.parts), str(e.path)))
    # Several equally good places: the shallowest wins, unless two are equally shallow (or none is a lab folder).
    if len(candidates) > 1 and (best == 4 or len(candidates[0].path.parts) == len(candidates[1].path.parts)):
        listed = ", ".join(str(c.path) for c in candidates[:3])
        return Found(learner, lab, None, "", f"ambiguous: several files could be lab {lab.number}'s ({listed})")
    entry = candidates[0]
    where = f"{learner}/{entry.path}"
    if entry.link:
        return Found(learner, lab, None, where, f"{entry.path} is a symbolic link: not graded (submit the file itself)")
    if entry.size > MAX_BYTES:
        return Found(learner, lab, None, where, f"{entry.path} is {entry.size} bytes: too large to be a lab file")
    try:
        content = entry.read()
    except OSError as exc:
        return Found(learner, lab, None, where, f"{entry.path} cannot be read: {exc.strerror or exc}")
    if len(content) > MAX_BYTES:
        return Found(learner, lab, None, where, f"{entry.path} is over {MAX_BYTES} bytes: too large to be a lab file")
    return Found(learner, lab, content, where)
