"""A generated class for trying `msglab grade` (and for `make bench` and the tests): real files, known answers.

Each learner hands in, per lab, one of: the reference solution, the starter untouched, a known
wrong variant (tests/variants/NN_x/*.py, whose `Expect: fail <checks>` line says what it must
fail), a correct variant written differently (also_right/), a file that does not import, or
nothing. Layouts vary as they do in a real class (a whole copy of the course, lab folders, bare
files). `manifest.json` records what each learner handed in and what it must get.

It needs the instructor's course (solutions/ and tests/variants/), never the learner edition.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from msglab.catalog import Lab, all_labs, course_root

EXPECT = re.compile(r"^\s*Expect:\s*(pass|fail)\b\s*(.*)$", re.M)
BROKEN = "import asyncio\n\n\nasync def worker(env)\n    pass\n"  # a syntax error on line 4
LAYOUTS = ("course", "lab folders", "bare files")


def variants(lab: Lab, root: Path | None = None) -> list[tuple[str, Path, bool, list[str]]]:
    """(name, path, passes, checks it must fail) for every variant of a lab."""
    folder = (root or course_root()) / "tests" / "variants" / lab.name
    found = []
    for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
        match = EXPECT.search(path.read_text(encoding="utf-8"))
        if not match:
            continue
        checks = [c.strip() for c in match.group(2).split(",") if c.strip()]
        found.append((str(path.relative_to(folder).with_suffix("")), path, match.group(1) == "pass", checks))
    return found


def make_class(folder: Path, learners: int = 30, labs: list[Lab] | None = None) -> dict[str, Any]:
    """Write `learners` submissions into `folder` (one folder each) and return the manifest."""
    labs = labs or all_labs()
    folder.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {}
    for i in range(learners):
        learner = f"learner{i + 1:02d}"
        layout = LAYOUTS[i % len(LAYOUTS)]
        manifest[learner] = {"layout": layout, "labs": {}}
        for j, lab in enumerate(labs):
            kind, content, passes, checks = _pick(i, j, lab)
            manifest[learner]["labs"][lab.name] = {"kind": kind, "passes": passes, "must_fail": checks}
            if content is None:
                continue
            if layout == "course":
                target = folder / learner / "labs" / lab.name / lab.file
            elif layout == "lab folders" or sum(other.file == lab.file for other in labs) > 1:
                target = folder / learner / lab.name / lab.file
            else:
                target = folder / learner / lab.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
            if layout == "course" and kind != "solution":  # a whole copy of the course carries its other files
                for sibling in lab.folder.iterdir():
                    if sibling.is_file() and sibling.name != lab.file:
                        (target.parent / sibling.name).write_bytes(sibling.read_bytes())
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _pick(i: int, j: int, lab: Lab) -> tuple[str, bytes | None, bool, list[str]]:
    """What learner i hands in for lab j: a mix where every kind appears in a class of 10 or more."""
    wrong = [v for v in variants(lab) if not v[2]]
    right = [v for v in variants(lab) if v[2]]
    slot = (i + 3 * j) % 10
    if slot in (0, 1, 2) or (slot == 3 and not right):
        return "solution", lab.source(solution=True).read_bytes(), True, []
    if slot == 3:
        name, path, _, _ = right[(i // 10) % len(right)]
        return f"also_right:{name}", path.read_bytes(), True, []
    if slot == 4:
        return "starter", lab.source().read_bytes(), False, []
    if slot == 5 and i % 2:
        return "missing", None, False, []
    if slot == 5:
        return "broken", BROKEN.encode(), False, ["file_imports"]
    if not wrong:
        return "starter", lab.source().read_bytes(), False, []
    name, path, _, checks = wrong[(i + j) % len(wrong)]
    return f"wrong:{name}", path.read_bytes(), False, checks


def copy_course(dest: Path, labs: list[str] | None = None, root: Path | None = None) -> Path:
    """A grading course: the labs (all, or these folder names) with their solutions and variants, no lessons."""
    root = root or course_root()
    names = labs or [lab.name for lab in all_labs(root)]
    for name in names:
        for folder in ("labs", "solutions", "tests/variants"):
            if (root / folder / name).is_dir():
                shutil.copytree(
                    root / folder / name, dest / folder / name, ignore=shutil.ignore_patterns("__pycache__")
                )
    return dest


def declare_points(root: Path) -> list[str]:
    """Give every lab of the course at `root` that declares no checks a [points] table; return those labs.

    The checks are those of its solution's verdict (seed 1), the first worth 3 points, the others 1:
    what a lab.toml holds once its author adds [points]. Grades each such solution once.
    """
    from msglab.classroom.points import lab_points

    saved = os.environ.get("MSGLAB_ROOT")
    os.environ["MSGLAB_ROOT"] = str(root)
    try:
        done = []
        for lab in all_labs(root):
            if not lab_points(lab).points:
                with open(lab.folder / "lab.toml", "a", encoding="utf-8") as handle:
                    handle.write(points_table(lab.number))
                done.append(lab.name)
        return done
    finally:
        if saved is None:
            os.environ.pop("MSGLAB_ROOT", None)
        else:
            os.environ["MSGLAB_ROOT"] = saved


def points_table(lab: str) -> str:
    """A [points] table for a lab of the current course: its solution's checks, the first worth 3 points."""
    from msglab.grading.grade import grade

    checks = [check.name for check in grade(lab, solution=True, seed=1).checks]
    return "\n[points]\n" + "".join(f"{check} = {3 if i == 0 else 1}\n" for i, check in enumerate(checks))
