"""The course's table of contents: lessons, labs and solutions, found by their numbered names.

`labs/NN_name/` holds what the learner edits plus `lab.toml` (its metadata and hints, as rustlings
keeps info.toml beside each exercise); `solutions/NN_name/` holds the same file solved; the grader
is `msglab.graders.name` (the name without its number).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from msglab.errors import LabError, NotebookError, UnknownLab

NAME_RULE = re.compile(r"^(\d\d)_([a-z0-9_]+)$")
HINT_KEYS = ("concept", "lesson", "code")  # what a lab.toml `[hints.<check id>]` table may hold


def course_root() -> Path:
    """The checkout's top folder (MSGLAB_ROOT overrides, for graders run elsewhere)."""
    env = os.environ.get("MSGLAB_ROOT")
    return Path(env).resolve() if env else Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Hint:
    """The levels of help for one check, from lab.toml's `[hints.<check id>]` (level 1 is the verdict)."""

    concept: str = ""  # level 2: the idea, no code
    lesson: str = ""  # level 2: where a lesson cell shows it
    code: str = ""  # level 3: code-level

    @property
    def top_level(self) -> int:
        """The highest level this hint has content for (1: nothing beyond the verdict)."""
        return 3 if self.code else 2 if self.concept or self.lesson else 1


@dataclass(frozen=True)
class Lab:
    """One lab: its folder, the file the learner edits, and its grader module."""

    number: str
    name: str  # full folder name, e.g. 01_request_reply_vs_events
    title: str
    file: str  # the file the grader imports, relative to the lab folder
    folder: Path
    solution_folder: Path
    lesson: str = ""  # the lesson notebook, relative to the course root
    hints: dict[str, Hint] = field(default_factory=dict, compare=False, hash=False)  # by check id
    grader: str = ""  # the grader module, when it is not msglab.graders.<topic> (the example lab's)

    @property
    def checks(self) -> list[str]:
        """The check ids this lab's hints cover: its own `[hints.*]` tables, then the platform's."""
        return list(self.hints)

    @property
    def topic(self) -> str:
        return self.name.split("_", 1)[1]

    @property
    def grader_module(self) -> str:
        return self.grader or f"msglab.graders.{self.topic}"

    def source(self, solution: bool = False) -> Path:
        """The file to grade: the learner's, or the reference solution's."""
        return (self.solution_folder if solution else self.folder) / self.file


def all_labs(root: Path | None = None) -> list[Lab]:
    """Every lab folder that follows the naming rule and has a lab.toml, in number order."""
    root = root or course_root()
    labs = []
    for folder in sorted((root / "labs").glob("*/lab.toml")):
        if NAME_RULE.match(folder.parent.name):
            labs.append(load_lab(folder.parent, root / "solutions" / folder.parent.name))
    return labs


def load_lab(folder: Path, solution_folder: Path | None = None) -> Lab:
    """The lab in `folder` (NN_name/ with a lab.toml), also one outside labs/: the course's example lab,
    `examples/00_echo`, which only the test suite grades (never listed, never in the learner's course).

    Its lab.toml may name its `grader` module and its `solution` folder (relative to the lab's folder).
    """
    match = NAME_RULE.match(folder.name)
    if not match:
        raise LabError(f"{folder} is not named NN_name", hint="a lab's folder is its number and name: 02_x")
    toml = folder / "lab.toml"
    try:
        meta = tomllib.loads(toml.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise LabError(f"{toml} is not valid TOML: {exc}", hint="fix that line of the lab's lab.toml") from exc
    if "solution" in meta:
        solution_folder = folder / str(meta["solution"])
    return Lab(
        number=match.group(1),
        name=folder.name,
        title=meta["title"],
        file=meta["file"],
        folder=folder,
        solution_folder=solution_folder or folder,
        lesson=str(meta.get("lesson", "")),
        hints=_merged_hints(_read_hints(toml, meta.get("hints", {}))),
        grader=str(meta.get("grader", "")),
    )


PLATFORM_HINTS = Path(__file__).resolve().parent / "grading" / "hints.toml"


def platform_hints() -> dict[str, Hint]:
    """The hints of the checks every lab shares (msglab/grading/hints.toml)."""
    return _read_hints(PLATFORM_HINTS, tomllib.loads(PLATFORM_HINTS.read_text()).get("hints", {}))


def _merged_hints(own: dict[str, Hint]) -> dict[str, Hint]:
    """A lab's hints over the platform's: a lab's table replaces the platform's table of that id."""
    return {**own, **{k: v for k, v in platform_hints().items() if k not in own}}


def _read_hints(toml_path: Path, table: object) -> dict[str, Hint]:
    """Parse `[hints.<check id>]` tables; a typo is the course's bug, so name the file and the key."""

    def broken(what: str) -> LabError:
        return LabError(f"{toml_path}: {what}", hint="hints are tables [hints.<check id>] with concept, lesson, code")

    if not isinstance(table, dict):
        raise broken("`hints` is not a table")
    hints = {}
    for check_id, levels in table.items():
        if not isinstance(levels, dict):
            raise broken(f"hints.{check_id} is not a table")
        if set(levels) - set(HINT_KEYS) or not all(isinstance(v, str) for v in levels.values()):
            raise broken(f"hints.{check_id} may only hold the strings {', '.join(HINT_KEYS)} (got {sorted(levels)})")
        hints[check_id] = Hint(**{k: v.strip() for k, v in levels.items()})
    return hints


def display_path(path: Path) -> str:
    """A path the learner can open: relative to the current folder inside the course, else absolute."""
    path, here, root = path.resolve(), Path.cwd().resolve(), course_root()
    if here.is_relative_to(root) and path.is_relative_to(root):
        return os.path.relpath(path, here)
    return str(path)


def find_lab(key: str, root: Path | None = None) -> Lab:
    """Resolve '1', '01', '01_request_reply_vs_events' or 'request_reply_vs_events'."""
    labs = all_labs(root)
    wanted = key.strip().rstrip("/").split("/")[-1]
    for lab in labs:
        if wanted in (lab.name, lab.topic) or (wanted.isdigit() and int(wanted) == int(lab.number)):
            return lab
    known = ", ".join(f"{lab.number} ({lab.name})" for lab in labs) or "none yet"
    raise UnknownLab(f"there is no lab called {key!r}", hint=f"labs are: {known}")


def all_notebooks(root: Path | None = None) -> list[Path]:
    """Every lesson and lab notebook of the course, in name order."""
    root = root or course_root()
    return sorted([*(root / "lessons").glob("*.ipynb"), *(root / "labs").glob("*/*.ipynb")])


def read_notebook(path: Path) -> dict[str, object]:
    """Parse a notebook file, or raise NotebookError saying where it is broken and how to restore it."""
    import json

    restore = f"restore it with `git checkout -- {path.name}` in its folder (your lab code lives in .py files)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise NotebookError(f"{path} cannot be read: {exc}", hint=restore) from exc
    except json.JSONDecodeError as exc:
        raise NotebookError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})", hint=restore
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or "nbformat" not in data:
        raise NotebookError(f"{path} is JSON but not a notebook (no cells or nbformat)", hint=restore)
    return data
