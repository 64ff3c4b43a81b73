"""A class's submissions: which file each learner handed in for each lab.

SUBMISSIONS is a folder with one folder per learner, or a zip holding the same (as a course
platform exports it). Inside a learner's folder, a lab's file is found by its name (lab.toml's
`file`), in any of these layouts:

    alice/labs/01_request_reply_vs_events/orders.py   the course's own layout (a whole copy of the course)
    alice/01_request_reply_vs_events/orders.py        lab folders only (also `01/` or the topic name)
    alice/orders.py                                   just the edited files (when no two labs share a name)

Platform exports understood: a zip whose learner folders sit in one wrapper folder (it is
skipped), Moodle's `Full Name_123_assignsubmission_file_/` folders (the suffix is dropped),
Canvas's flat `name_LATE_123_456_orders-1.py` files (learner `name_123`), and:

    assignment_4242_export/                 Gradescope's "Export Submissions" (zip or unzipped folder)
      submission_metadata.yml               submission_<id> -> :submitters: [{:name:, :sid:, :email:}]
      submission_91817/orders.py            learner: the submitter's sid (else email, else name);
                                            a group is its sids joined with "+"
    take-home-submissions/                  GitHub Classroom (`gh classroom clone student-repos`)
      take-home-alice/.git, ...             learner: the login, without the assignment's prefix

A learner id is what seeds their runs, so it must not change between two exports of one class: a
sid, an email, a login, never Gradescope's submission id (a resubmission gets a new one). A layout
that cannot be understood (an export's metadata that does not match its folders, or no lab file in
any learner's folder at all) is a SubmissionsError, never a class of empty rows.

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
from typing import Any

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
GRADESCOPE_METADATA = "submission_metadata.yml"
_GRADESCOPE_FOLDER = re.compile(r"^submission_\d+$")


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


@dataclass(frozen=True)
class Person:
    """Who handed a submission in, as the platform's export names them (empty when it does not say)."""

    name: str = ""
    sid: str = ""
    email: str = ""


@dataclass
class Submissions:
    """Every learner's entries, by learner id, and notes on what was skipped."""

    source: str
    learners: dict[str, list[Entry]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    people: dict[str, list[Person]] = field(default_factory=dict)  # learner id -> submitters, when the export says
    shape: str = "folders"  # the layout understood: folders, gradescope export, github classroom
    repos: set[str] = field(default_factory=set)  # learner folders that are git repositories
    wrapper: str = ""  # the export's top folder's name, when it had one
    metadata: bytes | None = None  # Gradescope's submission_metadata.yml, when the export holds one

    def find(self, learner: str, lab: Lab, labs: list[Lab]) -> Found:
        """The learner's file for `lab` (`labs`: every lab of the course, to know which names are unique)."""
        return find_lab_file(learner, self.learners.get(learner, []), lab, labs)

    def require_lab_files(self, labs: list[Lab], course: list[Lab]) -> None:
        """Raise SubmissionsError when no learner's folder holds a file of any of `labs`: a layout not understood."""
        for learner in self.learners:
            if any(self.find(learner, lab, course).content is not None for lab in labs):
                return
        names = ", ".join(sorted(self.learners)[:3]) + (" ..." if len(self.learners) > 3 else "")
        files = ", ".join(sorted({lab.file for lab in labs}))
        raise SubmissionsError(
            f"{self.source}: layout not understood: no lab file ({files}) found for any of "
            f"{len(self.learners)} learner(s) ({names or 'none'}); nothing was graded (or nobody handed these labs in)",
            hint="give a folder (or zip) with one folder per learner, Gradescope's export, or GitHub Classroom's "
            "repositories (see `msglab grade --help`)",
        )


def read_submissions(path: Path, assignment: str = "") -> Submissions:
    """Read a submissions folder or zip (see the module docstring).

    assignment: GitHub Classroom's assignment prefix of the repositories' names (default: found).
    """
    if path.is_dir():
        return _platforms(_from_folder(path), assignment)
    if path.is_file() and zipfile.is_zipfile(path):
        return _platforms(_from_zip(path), assignment)
    if not path.exists():
        raise SubmissionsError(f"{path} does not exist", hint="give the folder (one folder per learner) or a zip")
    raise SubmissionsError(f"{path} is neither a folder nor a zip file", hint="give the folder or the platform's zip")


def _learner_id(name: str) -> str:
    match = _MOODLE.match(name)
    return match.group("learner") if match else name


def _from_folder(root: Path) -> Submissions:
    found = Submissions(str(root))
    inside = [e for e in os.scandir(root) if not e.name.startswith(".") and e.name not in SKIP_DIRS]
    if len(inside) == 1 and inside[0].is_dir(follow_symlinks=False) and _is_wrapper(Path(inside[0].path)):
        root = Path(inside[0].path)  # the export's own top folder, unzipped as it is
    found.wrapper = root.name
    for item in sorted(os.scandir(root), key=lambda e: e.name):
        if item.name == GRADESCOPE_METADATA and item.is_file(follow_symlinks=False):
            found.metadata = _file_reader(Path(item.path))()
            continue
        if item.name.startswith(".") or item.name in SKIP_DIRS:
            continue
        if item.is_symlink():
            found.notes.append(f"{item.name}: a symbolic link, skipped (links are never followed)")
        elif item.is_dir(follow_symlinks=False):
            found.learners.setdefault(_learner_id(item.name), []).extend(walk(Path(item.path)))
            if os.path.lexists(os.path.join(item.path, ".git")):
                found.repos.add(_learner_id(item.name))
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
    repos: set[tuple[str, ...]] = set()  # the folders holding a .git: GitHub Classroom's repositories
    for info in archive.infolist():
        parts = PurePosixPath(info.filename.replace("\\", "/")).parts
        if ".git" in parts and ".." not in parts:
            repos.add(parts[: parts.index(".git")])
        if info.is_dir() or not parts or any(p in ("..", "") or p.startswith(".") or p in SKIP_DIRS for p in parts):
            continue
        members.append((parts, info))
    # Wrapper folders (an export's top folder) hold learner folders and platform files, never a
    # lab's file or folder: a single top folder holding one of those is a learner's, not a wrapper.
    depth = 0
    while members and len({parts[0] for parts, _ in members}) == 1 and all(len(parts) > 1 for parts, _ in members):
        inside = [parts[1:] for parts, _ in members]
        if any(_looks_like_lab_folder(rest[0]) if len(rest) > 1 else not _platform_file(rest[0]) for rest in inside):
            break
        found.wrapper = members[0][0][0]
        members = [(parts[1:], info) for parts, info in members]
        depth += 1

    def reader(info: zipfile.ZipInfo) -> Callable[[], bytes]:
        def read() -> bytes:
            with archive.open(info) as handle:  # never extracted: read at most MAX_BYTES + 1
                return handle.read(MAX_BYTES + 1)

        return read

    for parts, info in members:
        link = stat.S_ISLNK(info.external_attr >> 16)
        if parts == (GRADESCOPE_METADATA,):
            found.metadata = reader(info)()
            continue
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
    found.repos = {_learner_id(repo[depth]) for repo in repos if len(repo) == depth + 1}
    return found


def _platform_file(name: str) -> bool:
    """A file an export keeps beside its learners' folders (or a Canvas learner's flat file)."""
    return name == GRADESCOPE_METADATA or bool(_CANVAS.match(name))


def _is_wrapper(folder: Path) -> bool:
    """An export's top folder, unzipped: it holds Gradescope's metadata, or is GitHub Classroom's `*-submissions`."""
    return (folder / GRADESCOPE_METADATA).is_file() or folder.name.endswith("-submissions")


# --- platforms ----------------------------------------------------------------------------------


def _platforms(found: Submissions, assignment: str) -> Submissions:
    """Learner ids as the platform that exported the submissions knows them."""
    if found.metadata is not None:
        return _gradescope(found)
    if any(_GRADESCOPE_FOLDER.match(name) for name in found.learners):
        raise SubmissionsError(
            f"{found.source}: submission_<id> folders without Gradescope's {GRADESCOPE_METADATA}: the learners "
            "cannot be told apart from their submissions",
            hint="grade the whole export as Gradescope writes it (the zip, or its assignment_<id>_export folder)",
        )
    if assignment or (found.repos and found.repos == set(found.learners)):
        return _github_classroom(found, assignment)
    return found


def _gradescope(found: Submissions) -> Submissions:
    """Map each submission_<id> folder to its submitters, from the export's submission_metadata.yml."""
    assert found.metadata is not None

    def broken(what: str) -> SubmissionsError:
        hint = "export the submissions again from Gradescope and grade the zip as it is"
        return SubmissionsError(f"{found.source}: Gradescope's {GRADESCOPE_METADATA} {what}", hint=hint)

    try:
        data = _load_yaml(found.metadata)
    except Exception as exc:  # any YAML or decoding error: the export is not what Gradescope writes
        raise broken(f"cannot be read: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict) or not data:
        raise broken("lists no submissions")
    learners: dict[str, list[Entry]] = {}
    people: dict[str, list[Person]] = {}
    for folder, record in sorted(data.items(), key=lambda item: str(item[0])):
        submitters = _plain(record).get("submitters") if isinstance(record, dict) else None
        if not _GRADESCOPE_FOLDER.match(str(folder)) or not isinstance(submitters, list) or not submitters:
            raise broken(f"has an entry that is not a submission with submitters: {str(folder)[:60]!r}")
        persons = [_person(s) for s in submitters]
        ids = [p.sid or p.email or p.name for p in persons]
        if not all(ids):
            raise broken(f"names a submitter of {folder} with no sid, email or name")
        learner = "+".join(ids)
        if learner in learners:
            raise broken(f"lists {learner} in two submissions ({folder} and another)")
        learners[learner] = found.learners.get(str(folder), [])
        people[learner] = persons
    unlisted = sorted(set(found.learners) - set(data))
    if unlisted:
        raise broken(f"does not list the folder(s) {', '.join(unlisted[:3])}: not the export's own metadata")
    found.learners, found.people, found.shape = learners, people, "gradescope export"
    return found


def _load_yaml(text: bytes) -> Any:
    """YAML as Gradescope's Ruby writes it: plain mappings, plus tags such as !ruby/hash read as what they hold."""
    import yaml  # PyYAML (JupyterLab's dependency, through jupyter_events)

    class Loader(yaml.SafeLoader):
        pass

    def untagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return loader.construct_scalar(node)

    Loader.add_multi_constructor("!", untagged)
    return yaml.load(text.decode("utf-8"), Loader=Loader)  # a SafeLoader: no arbitrary objects


def _plain(record: dict[Any, Any]) -> dict[str, Any]:
    """Ruby's symbol keys (`:sid`) as plain names."""
    return {str(key).lstrip(":"): value for key, value in record.items()}


def _person(submitter: Any) -> Person:
    fields = _plain(submitter) if isinstance(submitter, dict) else {}
    text = {key: "" if fields.get(key) is None else str(fields[key]).strip() for key in ("name", "sid", "email")}
    return Person(**text)


def _github_classroom(found: Submissions, assignment: str) -> Submissions:
    """Repositories named `<assignment>-<login>`: the learner is the login."""
    names = sorted(found.learners)
    if assignment:
        prefix = assignment.rstrip("-") + "-"
    elif found.wrapper.endswith("-submissions") and all(
        n.startswith(_slug(found.wrapper.removesuffix("-submissions")) + "-") for n in names
    ):
        prefix = _slug(found.wrapper.removesuffix("-submissions")) + "-"
    elif len(names) > 1:
        common = os.path.commonprefix(names)  # noqa: RUF071 (names, not paths)
        prefix = common[: common.rfind("-") + 1]
    else:
        prefix = ""
    if not prefix or not all(n.startswith(prefix) and len(n) > len(prefix) for n in names):
        if assignment:
            raise SubmissionsError(f"{found.source}: not every repository is named {prefix}<login>",
                                   hint="give the assignment's prefix as the repositories' names start")  # fmt: skip
        found.notes.append("git repositories with no common `<assignment>-` prefix: their folder names are the ids")
        return found
    found.learners = {name[len(prefix) :]: entries for name, entries in found.learners.items()}
    found.repos = {name[len(prefix) :] for name in found.repos}
    found.people = {login: [Person(name=login)] for login in found.learners}
    found.shape = "github classroom"
    found.notes.append(f"GitHub Classroom repositories: learner ids are the logins after {prefix!r}")
    return found


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


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
