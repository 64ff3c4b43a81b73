"""The learner edition: no answers in it, nothing in it that needs them, and it works end to end.

Its lessons run under nbval like the instructor's: lesson 00 (the one that used to run a
solution) and a lab notebook are executed in the edition itself; the other notebooks are the
instructor's byte for byte (checked here) and free of any mention of the solutions (checked
here), and the suite already runs those under nbval.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from msglab.catalog import all_labs, find_lab
from msglab.classroom.edition import (
    MARKER,
    ReleaseError,
    build_edition,
    is_learner_edition,
    require_solution,
    solution_references,
)
from msglab.errors import LabError


@pytest.fixture(scope="module")
def edition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The learner edition of this checkout, written once (with solution references allowed, to test the rest)."""
    out = tmp_path_factory.mktemp("release") / "msglab-learners"
    build_edition(out, ROOT, strict=False)
    yield out


def test_no_lesson_or_lab_sends_a_learner_of_the_edition_to_the_solutions() -> None:
    found = solution_references(ROOT)
    listed = "\n".join(f"  {ref}" for ref in found)
    assert not found, (
        f"`msglab release` refuses to write the learner edition: {len(found)} place(s) in the lessons and labs "
        f"need solutions/, which the edition does not have:\n{listed}"
    )


def test_the_edition_holds_the_course_without_its_answers(edition: Path) -> None:
    left_out = ("solutions", "tests", "conftest.py", "scripts", ".ci", "docs/instructors.md", "var", ".msglab", ".venv")
    for gone in left_out:
        assert not (edition / gone).exists(), gone
    assert is_learner_edition(edition) and 'kind = "learner"' in (edition / MARKER).read_text()
    for lab in all_labs(ROOT):
        copy = edition / "labs" / lab.name
        assert (copy / lab.file).is_file() and (copy / "lab.toml").is_file()
        for path in lab.folder.iterdir():
            if path.is_file() and not path.name.endswith(".pyc"):
                assert (copy / path.name).read_bytes() == path.read_bytes(), path
    assert sorted(p.name for p in (edition / "lessons").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "lessons").glob("*.ipynb")
    )
    for needed in ("pyproject.toml", "Makefile", "msglab/grading/grade.py", "msglab/graders/__init__.py"):
        assert (edition / needed).is_file(), needed
    assert (edition / "README.md").read_text().startswith("> **Learner edition.**")
    assert not list(edition.rglob("__pycache__")) and not list(edition.rglob("*.pyc"))
    log = subprocess.run(["git", "log", "--oneline"], cwd=edition, capture_output=True, text=True, check=True)
    assert len(log.stdout.splitlines()) == 1  # one commit: `msglab reset` restores starters from it
    status = subprocess.run(["git", "status", "--porcelain"], cwd=edition, capture_output=True, text=True, check=True)
    assert status.stdout == ""


def test_release_refuses_a_course_whose_lessons_point_at_the_solutions(tmp_path: Path) -> None:
    course = tmp_path / "course"
    (course / "labs" / "01_demo").mkdir(parents=True)
    (course / "labs" / "01_demo" / "lab.toml").write_text('title = "demo"\nfile = "demo.py"\n')
    (course / "labs" / "01_demo" / "demo.py").write_text("x = 1\n")
    (course / "labs" / "01_demo" / "README.md").write_text("# Demo\n\nStuck? See `solutions/01_demo/demo.py`.\n")
    (course / "solutions" / "01_demo").mkdir(parents=True)
    (course / "solutions" / "01_demo" / "demo.py").write_text("x = 2\n")
    with pytest.raises(ReleaseError) as raised:
        build_edition(tmp_path / "out", course)
    assert "labs/01_demo/README.md (line 3)" in str(raised.value)
    assert not (tmp_path / "out").exists(), "nothing is written when the release is refused"
    edition = build_edition(tmp_path / "out", course, strict=False, git=False)
    assert not (tmp_path / "out" / "solutions").exists() and edition.references
    with pytest.raises(ReleaseError, match="not empty"):
        build_edition(tmp_path / "out", course, strict=False)
    build_edition(tmp_path / "out", course, strict=False, replace=True)  # an earlier edition may be replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    with pytest.raises(ReleaseError, match="other than a learner edition"):
        build_edition(tmp_path / "mine", course, strict=False, replace=True)
    assert (tmp_path / "mine" / "thesis.tex").exists()


def test_asking_the_edition_for_a_solution_says_it_has_none(edition: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSGLAB_ROOT", str(edition))
    with pytest.raises(LabError, match="this edition has no reference solutions"):
        require_solution(find_lab("01"))
    done = run_cli("check", "01", "--solution", env={"MSGLAB_ROOT": str(edition)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "this edition has no reference solutions" in done.stderr, (
        "msglab check --solution in the learner edition must say so; wire "
        "msglab.classroom.edition.require_solution(lab) into msglab/grading/grade.py (see the classroom report):\n"
        + done.stderr
    )


def test_the_edition_starters_fail_with_teaching_messages(edition: Path, monkeypatch: pytest.MonkeyPatch,
                                                          no_nats_url: None) -> None:  # fmt: skip
    from msglab.grading.grade import grade

    monkeypatch.setenv("MSGLAB_ROOT", str(edition))
    labs = all_labs()
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda lab: grade(lab.number, seed=1), labs))
    for lab, verdict in zip(labs, verdicts, strict=True):
        assert not verdict.passed, f"lab {lab.number}'s starter passes in the edition:\n{verdict.to_text()}"
        assert verdict.graded == f"labs/{lab.name}/{lab.file}"
        assert all(c.message and c.hint for c in verdict.failures), verdict.to_text()
        assert "Traceback" not in "\n".join(c.message for c in verdict.failures)


def test_the_edition_notebooks_run_in_nbval(edition: Path, tmp_path: Path) -> None:
    for notebook in [*edition.glob("lessons/*.ipynb"), *edition.glob("labs/*/lab.ipynb")]:
        original = ROOT / notebook.relative_to(edition)
        assert notebook.read_bytes() == original.read_bytes(), f"{notebook.name} differs from the instructor's"
    run = [*sorted(edition.glob("lessons/00_*.ipynb")), *sorted(edition.glob("labs/*/lab.ipynb"))[:1]]
    env = {"MSGLAB_ROOT": str(edition), "MSGLAB_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-cell-timeout=120", "-p", "no:cacheprovider",
         "-n", "0", "-q", "--rootdir", str(edition), *map(str, run)],
        capture_output=True, text=True, cwd=edition, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k != "NATS_URL"}, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
