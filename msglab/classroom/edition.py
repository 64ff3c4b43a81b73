"""The learner edition: `msglab release --out DIR` writes the course without its answers.

Left out: `solutions/` (the reference solutions), `tests/` (its also_right/ variants are correct
solutions too, and the wrong ones come with their diagnosis) and conftest.py, `scripts/`, `.ci/`,
`docs/instructors.md`, and everything git ignores (.venv, var/, the learner state in .msglab/).
Everything else is copied as it is: lessons, labs (their starters, READMEs, lab.toml, notebooks),
the msglab package with its graders, pyproject.toml, the Makefile. The edition is a git
repository of one commit (so `msglab reset` can restore a starter) with an `edition.toml` that
says what it is; `msglab check NN --solution` in it says that this edition has no reference
solutions.

Nothing in the edition may need what was left out: a lesson, lab README, lab notebook or lab file
that mentions `solutions/`, `--solution` or `solution=True` stops the release (it would send a
learner to something that is not there), naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from msglab.catalog import Lab, course_root
from msglab.errors import LabError, MsglabError

MARKER = "edition.toml"
LEFT_OUT = ("solutions/", "tests/", "conftest.py", "scripts/", ".ci/", "docs/instructors.md", "var/", ".msglab/",
            "wheelhouse/", "grades/", "classroom/", "autograder/")  # fmt: skip
NEVER = re.compile(r"(^|/)(__pycache__|\.ipynb_checkpoints|\.git|\.venv|\.mypy_cache|\.ruff_cache|\.pytest_cache)(/|$)"
                   r"|\.pyc$|\.egg-info(/|$)")  # fmt: skip
REFERENCE = re.compile(r"solutions/|--solution\b|solution\s*=\s*True")
BANNER = """> **Learner edition.** This copy of the course has no reference solutions: `msglab check NN`
> grades your own file; `--solution` is not available here. Ask your instructor when you are stuck.

"""


class ReleaseError(MsglabError):
    """The learner edition cannot be written as asked."""


@dataclass(frozen=True)
class Reference:
    """A place in the course that points a learner at the solutions."""

    path: str  # relative to the course root
    where: str  # "line 33" or "cell 21"
    text: str

    def __str__(self) -> str:
        return f"{self.path} ({self.where}): {self.text}"


@dataclass
class Edition:
    """What `build_edition` wrote."""

    out: Path
    files: list[str]
    left_out: list[str]
    references: list[Reference] = field(default_factory=list)  # only when written with strict=False
    readme_notes: list[Reference] = field(default_factory=list)  # mentions in the top README (a banner covers them)
    commit: str = ""


def is_learner_edition(root: Path | None = None) -> bool:
    """True inside a learner edition written by `msglab release`."""
    return ((root or course_root()) / MARKER).is_file()


def require_solution(lab: Lab) -> None:
    """Raise LabError, clearly, when the lab's reference solution is not in this copy of the course."""
    if lab.source(solution=True).is_file():
        return
    if is_learner_edition() or not (course_root() / "solutions").is_dir():
        raise LabError(
            "this edition has no reference solutions: it is the learner edition of the course",
            hint=f"`msglab check {lab.number}` grades your own file, and `msglab hint {lab.number}` opens hints "
            "as you go; your instructor has the solutions",
        )
    raise LabError(f"lab {lab.number} has no reference solution: {lab.source(solution=True)} is missing",
                   hint=f"add solutions/{lab.name}/{lab.file}")  # fmt: skip


def course_files(root: Path) -> list[str]:
    """The course's files (posix paths relative to root): what git tracks or would track, or a walk."""
    try:
        done = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                              capture_output=True, check=True)  # fmt: skip
        names = [n for n in done.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    return sorted({n for n in names if (root / n).is_file() and not (root / n).is_symlink() and not NEVER.search(n)})


def _left_out(name: str) -> bool:
    return any(name == prefix.rstrip("/") or name.startswith(prefix) for prefix in LEFT_OUT)


def needs_checking(name: str) -> bool:
    """The files a learner is sent to: lessons, and every lab's README, notebook and files."""
    path = PurePosixPath(name)
    return (path.parts[0] == "lessons" and path.suffix in (".ipynb", ".md")) or (
        path.parts[0] == "labs" and path.suffix in (".md", ".ipynb", ".py", ".toml")
    )


def references_in(path: Path, name: str) -> list[Reference]:
    """Every mention of the solutions in one file (notebook cells by number, other files by line)."""
    found = []
    if path.suffix == ".ipynb":
        try:
            cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        except (OSError, ValueError):
            return [Reference(name, "whole file", "not a readable notebook")]
        for number, cell in enumerate(cells, 1):
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else str(source)
            for line in text.splitlines():
                if REFERENCE.search(line):
                    found.append(Reference(name, f"cell {number}", line.strip()[:160]))
        return found
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if REFERENCE.search(line):
            found.append(Reference(name, f"line {number}", line.strip()[:160]))
    return found


def solution_references(root: Path | None = None) -> list[Reference]:
    """Every place in the lessons and labs that would send a learner of the edition to the solutions."""
    root = root or course_root()
    found: list[Reference] = []
    for name in course_files(root):
        if not _left_out(name) and needs_checking(name):
            found += references_in(root / name, name)
    return found


def build_edition(out: Path, root: Path | None = None, *, strict: bool = True, git: bool = True,
                  replace: bool = False) -> Edition:  # fmt: skip
    """Write the learner edition of the course at `root` into `out`.

    strict: refuse (ReleaseError, nothing written) when a lesson or lab mentions the solutions.
    replace: `out` may hold an earlier edition, which is removed first (never any other folder).
    """
    root = (root or course_root()).resolve()
    out = out.resolve()
    if out == root or (out.is_relative_to(root) and not _left_out(out.relative_to(root).as_posix() + "/")):
        raise ReleaseError(f"{out} is inside the course", hint="write the edition outside the course, or under var/")
    references = solution_references(root)
    if strict and references:
        listed = "\n".join(f"  {ref}" for ref in references)
        raise ReleaseError(
            f"the learner edition has no solutions/, but {len(references)} place(s) in the lessons and labs "
            f"send learners there:\n{listed}",
            hint="rewrite those lines so that they need no reference solution, then release again",
        )
    _prepare(out, replace)
    files, left_out = [], []
    for name in course_files(root):
        if _left_out(name):
            left_out.append(name)
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
        files.append(name)
    readme = out / "README.md"
    notes = references_in(readme, "README.md") if readme.is_file() else []
    if readme.is_file():
        readme.write_text(BANNER + readme.read_text(encoding="utf-8"), encoding="utf-8")
    labs = sorted({PurePosixPath(n).parts[1] for n in files if n.startswith("labs/") and n.endswith("/lab.toml")})
    source = _commit_of(root)
    (out / MARKER).write_text(
        "# The learner edition of msglab, written by `msglab release`: no solutions/, no tests/.\n"
        'kind = "learner"\n'
        f'built = "{datetime.now(UTC).isoformat(timespec="seconds")}"\n'
        f'from_commit = "{source}"\n'
        f"labs = {json.dumps(labs)}\n",
        encoding="utf-8",
    )
    files.append(MARKER)
    edition = Edition(out, files, left_out, references if not strict else [], notes)
    if git:
        edition.commit = _git_commit(out)
    return edition


def _prepare(out: Path, replace: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not replace:
            raise ReleaseError(f"{out} exists and is not empty", hint="choose a new folder, or --replace an edition")
        if not (out / MARKER).is_file():
            raise ReleaseError(f"{out} holds something other than a learner edition: not replaced",
                               hint="choose a new folder")  # fmt: skip
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _commit_of(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _git_commit(out: Path) -> str:
    """Make the edition a repository of one commit (`msglab reset` restores starters from git); '' without git."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "msglab release", "GIT_AUTHOR_EMAIL": "msglab@localhost",
           "GIT_COMMITTER_NAME": "msglab release", "GIT_COMMITTER_EMAIL": "msglab@localhost"}  # fmt: skip
    try:
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "msglab: learner edition"]):
            subprocess.run(["git", *args], cwd=out, env=env, capture_output=True, check=True)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=out, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip()
