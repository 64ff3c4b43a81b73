"""The course's table of contents: lessons, labs and solutions, found by their numbered names.

`labs/NN_name/` holds what the learner edits plus `lab.toml` (its metadata, as rustlings keeps
info.toml beside each exercise); `solutions/NN_name/` holds the same file solved; the grader is
`msglab.graders.name` (the name without its number).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from msglab.errors import NotebookError, UnknownLab

NAME_RULE = re.compile(r"^(\d\d)_([a-z0-9_]+)$")


def course_root() -> Path:
    """The checkout's top folder (MSGLAB_ROOT overrides, for graders run elsewhere)."""
    env = os.environ.get("MSGLAB_ROOT")
    return Path(env).resolve() if env else Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Lab:
    """One lab: its folder, the file the learner edits, and its grader module."""

    number: str
    name: str  # full folder name, e.g. 01_request_reply_vs_events
    title: str
    file: str  # the file the grader imports, relative to the lab folder
    folder: Path
    solution_folder: Path

    @property
    def topic(self) -> str:
        return self.name.split("_", 1)[1]

    @property
    def grader_module(self) -> str:
        return f"msglab.graders.{self.topic}"

    def source(self, solution: bool = False) -> Path:
        """The file to grade: the learner's, or the reference solution's."""
        return (self.solution_folder if solution else self.folder) / self.file


def all_labs(root: Path | None = None) -> list[Lab]:
    """Every lab folder that follows the naming rule and has a lab.toml, in number order."""
    root = root or course_root()
    labs = []
    for folder in sorted((root / "labs").glob("*/lab.toml")):
        match = NAME_RULE.match(folder.parent.name)
        if not match:
            continue
        meta = tomllib.loads(folder.read_text())
        labs.append(
            Lab(
                number=match.group(1),
                name=folder.parent.name,
                title=meta["title"],
                file=meta["file"],
                folder=folder.parent,
                solution_folder=root / "solutions" / folder.parent.name,
            )
        )
    return labs


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
