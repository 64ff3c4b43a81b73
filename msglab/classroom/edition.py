"""The learner edition: `msglab release --out DIR` writes the course without its answers.

It is built from the course's last commit (`git archive HEAD`), never from the working tree: a
solution pasted into a starter and not committed, or a file git does not track, never ships. A
working tree that differs from the commit in what would ship is refused, naming each difference
(`--allow-dirty` releases the commit all the same and lists what it left behind).

Left out: `solutions/` (the reference solutions), `tests/` (its also_right/ variants are correct
solutions too, and the wrong ones come with their diagnosis) and conftest.py, `scripts/`, `.ci/`,
`docs/instructors.md`, and everything git ignores (.venv, var/, the learner state in .msglab/).
Changed: every hint's code level (`code = ...` in lab.toml's `[hints.*]`, which pastes into a
passing file) is left out unless `--code-hints` (a self-study or workshop edition). Everything else
is copied as committed: lessons, labs (their starters, READMEs, notebooks), the msglab package with
its graders, pyproject.toml. The edition is a git repository of one commit (so `msglab reset` can
restore a starter) with an `edition.toml` that says what it is; `msglab check NN --solution` in it
says that this edition has no reference solutions. With `check_starters`, every starter is graded
once in the edition (seed 1): a starter that passes stops the release.

Nothing in the edition may need what was left out: a lesson, lab README, lab notebook or lab file
that mentions `solutions/`, `--solution` or `solution=True` stops the release (it would send a
learner to something that is not there), naming the file and line.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from msglab.catalog import Lab, course_root
from msglab.errors import LabError, MsglabError

MARKER = "edition.toml"
LEFT_OUT = ("solutions/", "tests/", "conftest.py", "scripts/", ".ci/", "docs/instructors.md", "var/", ".msglab/",
            "wheelhouse/", "grades/", "classroom/", "autograder/", "examples/", "docs/authoring.md")  # fmt: skip
NEVER = re.compile(r"(^|/)(__pycache__|\.ipynb_checkpoints|\.git|\.venv|\.mypy_cache|\.ruff_cache|\.pytest_cache)(/|$)"
                   r"|\.pyc$|\.egg-info(/|$)")  # fmt: skip
REFERENCE = re.compile(r"solutions/|--solution\b|solution\s*=\s*True")
TEMPLATES = Path(__file__).resolve().parent / "templates"  # the edition's own README, Makefile, tests, workflow
TEST_TOOLS = (
    "pytest",
    "nbval",
    "pytest-timeout",
)  # what the edition's `make test` adds, pinned as the course pins them


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
    readme_notes: list[Reference] = field(default_factory=list)  # unused: the edition's README is its own
    commit: str = ""
    source: str = ""  # the course's commit it was built from ("" when the course is not a git repository)
    not_shipped: list[str] = field(default_factory=list)  # working-tree changes left behind (--allow-dirty)
    code_hints: bool = False  # whether the hints' code level shipped


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
    """The course's files (posix paths relative to root): what git tracks or would track, or a walk.

    A walk where `root` is not the top of a git repository (a snapshot being released, a copy).
    """
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()  # fmt: skip
        if Path(top).resolve() != root.resolve():
            raise ValueError(top)
        done = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                              capture_output=True, check=True)  # fmt: skip
        names = [n for n in done.stdout.decode().split("\0") if n]
    except (OSError, ValueError, subprocess.CalledProcessError):
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
                  replace: bool = False, allow_dirty: bool = False, code_hints: bool = False,
                  check_starters: bool = False, own: bool = True) -> Edition:  # fmt: skip
    """Write the learner edition of the course at `root` (its last commit) into `out`.

    strict: refuse (ReleaseError, nothing written) when a lesson or lab mentions the solutions.
    replace: `out` may hold an earlier edition, which is removed first (never any other folder).
    allow_dirty: release the commit although the working tree differs from it (the differences are listed).
    code_hints: keep the hints' code level. check_starters: refuse when a starter passes its lab.
    own: write the edition's own README, Makefile, tests and workflow (not for a grader's copy of the course).
    """
    root = (root or course_root()).resolve()
    out = out.resolve()
    if out == root or (out.is_relative_to(root) and not _left_out(out.relative_to(root).as_posix() + "/")):
        raise ReleaseError(f"{out} is inside the course", hint="write the edition outside the course, or under var/")
    with tempfile.TemporaryDirectory(prefix="msglab-release-") as tmp:
        staging = Path(tmp) / "course"
        source, not_shipped = snapshot(root, staging, allow_dirty)
        references = solution_references(staging)
        if strict and references:
            listed = "\n".join(f"  {ref}" for ref in references)
            raise ReleaseError(
                f"the learner edition has no solutions/, but {len(references)} place(s) in the lessons and labs "
                f"send learners there:\n{listed}",
                hint="rewrite those lines so that they need no reference solution, then release again",
            )
        files, left_out = [], []
        for name in course_files(staging):
            if _left_out(name):
                left_out.append(name)
                (staging / name).unlink()
            else:
                files.append(name)
        if not code_hints:
            for name in files:
                if PurePosixPath(name).name in ("lab.toml", "hints.toml"):
                    path = staging / name
                    path.write_text(strip_code_hints(path.read_text(encoding="utf-8"), name), encoding="utf-8")
        if own:
            files += own_files(staging, source, code_hints)
        labs = sorted({PurePosixPath(n).parts[1] for n in files if n.startswith("labs/") and n.endswith("/lab.toml")})
        (staging / MARKER).write_text(
            "# The learner edition of msglab, written by `msglab release`: no solutions/, no tests/.\n"
            'kind = "learner"\n'
            f'built = "{datetime.now(UTC).isoformat(timespec="seconds")}"\n'
            f'from_commit = "{source or "unknown"}"\n'
            f"code_hints = {json.dumps(code_hints)}\n"
            f"labs = {json.dumps(labs)}\n",
            encoding="utf-8",
        )
        files.append(MARKER)
        if check_starters:
            refuse_passing_starters(staging, Path(tmp) / "state")
        _prepare(out, replace)
        for name in files:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(staging / name, target)
    edition = Edition(out, sorted(set(files)), left_out, references if not strict else [], source=source,
                      not_shipped=not_shipped, code_hints=code_hints)  # fmt: skip
    if git:
        edition.commit = _git_commit(out)
    return edition


def snapshot(root: Path, dest: Path, allow_dirty: bool = False) -> tuple[str, list[str]]:
    """Write the course's last commit into `dest`; return the commit and the working tree's differences.

    A working tree whose shipped files differ from the commit (modified, added, deleted, untracked)
    is a ReleaseError naming them, unless allow_dirty. A course that is not a git repository is
    copied as it is (returns "" as the commit).
    """
    dest.mkdir(parents=True)
    try:
        top = _git(root, "rev-parse", "--show-toplevel").decode().strip()
        head = _git(root, "rev-parse", "HEAD").decode().strip()
    except (OSError, subprocess.CalledProcessError):
        for name in course_files(root):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
        return "", []
    prefix = root.relative_to(Path(top).resolve()).as_posix() if root != Path(top).resolve() else ""
    changes = []
    status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", ".").decode()
    entries = iter(status.split("\0"))
    for entry in entries:
        if not entry:
            continue
        code, name = entry[:2], entry[3:]
        if code[0] in "RC":
            next(entries, None)  # a rename's second field: the old name
        name = name.removeprefix(f"{prefix}/") if prefix else name
        if _left_out(name) or NEVER.search(name):
            continue
        kind = {"??": "untracked", " M": "modified", "M ": "modified (staged)", " D": "deleted", "D ": "deleted",
                "A ": "added, not committed"}.get(code, f"changed ({code.strip()})")  # fmt: skip
        changes.append(f"{kind}: {name}")
    if changes and not allow_dirty:
        listed = "\n".join(f"  {change}" for change in changes[:30]) + ("\n  ..." if len(changes) > 30 else "")
        raise ReleaseError(
            f"the working tree differs from the last commit ({head[:12]}) in {len(changes)} file(s) the edition "
            f"would ship:\n{listed}",
            hint="commit (or discard) them and release again; or --allow-dirty releases the commit without them",
        )
    tree = f"HEAD:{prefix}" if prefix else "HEAD"
    archive = _git(root, "archive", "--format=tar", tree)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and not NEVER.search(m.name)]
        tar.extractall(dest, members=members, filter="data")
    return head, changes


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


_TABLE = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
_CODE = re.compile(r"^\s*code\s*=\s*(\"\"\"|\'\'\'|\"|\')")


def strip_code_hints(text: str, name: str = "lab.toml") -> str:
    """lab.toml without its hints' code level (`code = ...` in `[hints.*]` tables); everything else as it was."""
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    table, i = "", 0
    while i < len(lines):
        line = lines[i]
        if header := _TABLE.match(line):
            table = header.group(1)
        opening = _CODE.match(line) if table.startswith("hints.") else None
        if not opening:
            kept.append(line)
            i += 1
            continue
        quote = opening.group(1)
        rest = "".join(lines[i:])[opening.end() :]
        end = rest.find(quote)
        if end < 0:
            raise ReleaseError(f"{name}: a hint's code in [{table}] never closes its string")
        i += 1 + rest[: end + len(quote)].count("\n")  # the lines the value spans
    result = "".join(kept)
    before, after = tomllib.loads(text), tomllib.loads(result)
    for hint in before.get("hints", {}).values():
        if isinstance(hint, dict):
            hint.pop("code", None)
    if before != after:
        raise ReleaseError(f"{name}: the hints' code level could not be left out cleanly",
                           hint="write each hint's code as `code = \"\"\"...\"\"\"` on lines of its own")  # fmt: skip
    return result


def refuse_passing_starters(course: Path, state: Path) -> None:
    """Grade every starter of `course` once (seed 1); a starter that passes, or cannot be graded, is a ReleaseError."""
    from msglab.catalog import all_labs

    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env.update(MSGLAB_ROOT=str(course), MSGLAB_STATE_DIR=str(state))

    def check(lab: Lab) -> tuple[Lab, int, str]:
        done = subprocess.run([sys.executable, "-m", "msglab", "check", lab.number, "--seed", "1", "--json"],
                              capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        return lab, done.returncode, (done.stdout or done.stderr).strip()[:300]

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, all_labs(course)))
    wrong = [f"  lab {lab.number}: the starter passes (seed 1)" for lab, code, _ in results if code == 0]
    wrong += [f"  lab {lab.number}: the starter could not be graded: {said}" for lab, code, said in results
              if code not in (0, 1)]  # fmt: skip
    if wrong:
        hint = "commit the starter as learners should get it (a solution may have been left in labs/)"
        raise ReleaseError("a starter must fail its lab with a teaching message:\n" + "\n".join(wrong), hint=hint)


def own_files(course: Path, source: str, code_hints: bool) -> list[str]:
    """Write the edition's own README.md, Makefile, tests/test_edition.py and GitHub Classroom workflow into `course`.

    The course's README and Makefile are the instructor's (developer checks on folders the edition
    has not, links to this guide); the edition gets its own. Returns the files written.
    """
    from msglab.catalog import all_labs, read_notebook
    from msglab.classroom.points import lab_points, number

    labs = all_labs(course)
    lessons = sorted((course / "lessons").glob("*.ipynb"))
    rows = []
    for lesson in lessons:
        lab = next((lab for lab in labs if lab.number == lesson.name[:2]), None)
        title = _notebook_title(read_notebook(lesson)) or lesson.stem
        edit = f"[{lab.title}](labs/{lab.name}/README.md): `labs/{lab.name}/{lab.file}`" if lab else "–"
        rows.append(f"| {lesson.name[:2]} | [{title}](lessons/{lesson.name}) | {edit} |")
    hints = ("`msglab hint NN` opens the hints level by level as a check keeps failing, down to code."
             if code_hints else "`msglab hint NN` opens the hints (the idea, then where a lesson shows it) as a "
             "check keeps failing; ask your instructor when you are stuck.")  # fmt: skip
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    for key, value in (("@BUILT@", datetime.now(UTC).strftime("%Y-%m-%d")), ("@COMMIT@", source[:12] or "unknown"),
                       ("@HINTS@", hints), ("@SYLLABUS@", "\n".join(rows))):  # fmt: skip
        readme = readme.replace(key, value)
    (course / "README.md").write_text(readme, encoding="utf-8")
    (course / "Makefile").write_text(
        (TEMPLATES / "Makefile").read_text(encoding="utf-8").replace("@TEST_TOOLS@", " ".join(_pins(course))),
        encoding="utf-8",
    )
    (course / "tests").mkdir(exist_ok=True)
    shutil.copyfile(TEMPLATES / "test_edition.py", course / "tests" / "test_edition.py")
    steps, env, runners = [], [], []
    for lab in labs:
        step = f"lab-{lab.number}"
        steps.append(f"      - name: lab {lab.number}\n        id: {step}\n"
                     f"        uses: classroom-resources/autograding-command-grader@v1\n        with:\n"
                     f"          test-name: \"lab {lab.number}: {lab.title}\"\n"
                     f"          command: msglab check {lab.number}\n"
                     f"          timeout: 10\n          max-score: {number(lab_points(lab).maximum) or 1}")  # fmt: skip
        env.append(f'          {step.upper()}_RESULTS: "${{{{steps.{step}.outputs.result}}}}"')
        runners.append(step)
    workflow = (TEMPLATES / "classroom.yml").read_text(encoding="utf-8")
    workflow = workflow.replace("@STEPS@", "\n".join(steps)).replace("@ENV@", "\n".join(env))
    (course / ".github" / "workflows").mkdir(parents=True, exist_ok=True)
    (course / ".github" / "workflows" / "classroom.yml").write_text(workflow.replace("@RUNNERS@", ",".join(runners)))
    return ["README.md", "Makefile", "tests/test_edition.py", ".github/workflows/classroom.yml"]


def _notebook_title(notebook: dict[str, object]) -> str:
    """A notebook's first heading, without its '#' and any 'Lesson NN:' prefix."""
    cells = notebook.get("cells")
    for cell in cells if isinstance(cells, list) else []:
        source = cell.get("source", "") if isinstance(cell, dict) else ""
        text = "".join(source) if isinstance(source, list) else str(source)
        for line in text.splitlines():
            if line.startswith("# "):
                return re.sub(r"^(Lesson\s+)?\d+\s*[·:.-]\s*", "", line[2:].strip())
    return ""


def _pins(course: Path) -> list[str]:
    """The test tools as the course's pyproject.toml pins them (its dev extras), by name."""
    pyproject = course / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}) if pyproject.is_file() else {}
    dev = project.get("optional-dependencies", {}).get("dev", [])
    pins = {re.split(r"[=<>!~ \[]", dep, maxsplit=1)[0].lower(): dep for dep in dev}
    return [f"'{pins.get(name, name)}'" for name in TEST_TOOLS]


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
