"""The learner edition: no answers in it, nothing in it that needs them, and it works end to end.

Its lessons run under nbval like the instructor's: lesson 00 (the one that used to run a
solution) and a lab notebook are executed in the edition itself; the other notebooks are the
instructor's byte for byte (checked here) and free of any mention of the solutions (checked
here), and the suite already runs those under nbval.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from verdicts import DEPTH

from conftest import ROOT, run_cli
from msglab.catalog import all_labs, find_lab
from msglab.classroom.edition import (
    MARKER,
    ReleaseError,
    build_edition,
    is_learner_edition,
    require_solution,
    solution_references,
    strip_code_hints,
)
from msglab.classroom.points import lab_points
from msglab.errors import LabError


@pytest.fixture(scope="module")
def edition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The learner edition of this checkout's last commit, written once (solution references allowed, to test the rest).

    allow_dirty: engineers at work leave the checkout's tree dirty; the edition is the commit either way.
    """
    out = tmp_path_factory.mktemp("release") / "msglab-learners"
    build_edition(out, ROOT, strict=False, allow_dirty=True)
    yield out


def committed(name: str) -> bytes:
    """A file of the course as its last commit holds it (what the edition ships)."""
    return subprocess.run(["git", "show", f"HEAD:{name}"], cwd=ROOT, capture_output=True, check=True).stdout


def test_no_lesson_or_lab_sends_a_learner_of_the_edition_to_the_solutions() -> None:
    found = solution_references(ROOT)
    listed = "\n".join(f"  {ref}" for ref in found)
    assert not found, (
        f"`msglab release` refuses to write the learner edition: {len(found)} place(s) in the lessons and labs "
        f"need solutions/, which the edition does not have:\n{listed}"
    )


def test_the_edition_holds_the_course_without_its_answers(edition: Path) -> None:
    left_out = ("solutions", "tests/variants", "tests/hostile", "conftest.py", "scripts", ".ci", "docs/instructors.md",
                "var", ".msglab", ".venv", "examples", "docs/authoring.md")  # fmt: skip
    for gone in left_out:
        assert not (edition / gone).exists(), gone
    assert is_learner_edition(edition) and 'kind = "learner"' in (edition / MARKER).read_text()
    for lab in all_labs(ROOT):
        copy = edition / "labs" / lab.name
        assert (copy / lab.file).is_file() and (copy / "lab.toml").is_file()
        for path in copy.iterdir():
            name = f"labs/{lab.name}/{path.name}"
            if path.name == "lab.toml":  # its hints' code level is left out (see the test below)
                assert path.read_text() == strip_code_hints(committed(name).decode()), name
            else:
                assert path.read_bytes() == committed(name), name
    assert sorted(p.name for p in (edition / "lessons").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "lessons").glob("*.ipynb")
    )
    for needed in ("pyproject.toml", "Makefile", "msglab/grading/grade.py", "msglab/graders/__init__.py"):
        assert (edition / needed).is_file(), needed
    assert sorted(p.name for p in (edition / "tests").iterdir()) == ["test_edition.py"]  # its own, not the course's
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


@pytest.mark.skipif(
    DEPTH == "quick",
    reason="a quick run leaves the edition's starters to the edition's own make"
    " test (test_edition_make_test.py grades each there, with its message and hint)",
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


def test_the_edition_notebooks_are_the_instructors(edition: Path) -> None:
    # Byte for byte, so this suite's runs of them hold for the edition; lesson 00 and lab 01's notebook
    # also run in the edition's own make test (test_edition_make_test.py).
    for notebook in [*edition.glob("lessons/*.ipynb"), *edition.glob("labs/*/lab.ipynb")]:
        original = committed(notebook.relative_to(edition).as_posix())
        assert notebook.read_bytes() == original, f"{notebook.name} differs from the instructor's"


def git_course(root: Path) -> Path:
    """A one-lab course in a git repository of its own, committed."""
    lab = root / "labs" / "01_demo"
    lab.mkdir(parents=True)
    (lab / "demo.py").write_text("async def worker(env):\n    ...  # TODO: the work\n")
    (lab / "lab.toml").write_text(
        'title = "demo"\nfile = "demo.py"\n\n[hints.done]\nconcept = """The idea, no code."""\n'
        'lesson = "Part 1"\ncode = """\nawait env.do_it()  # the answer\n"""\n\n'
        "[hints.twice]\ncode = 'await env.once()'\nconcept = \"Once.\"\n"
    )
    (root / "solutions" / "01_demo").mkdir(parents=True)
    (root / "solutions" / "01_demo" / "demo.py").write_text("async def worker(env):\n    await env.do_it()\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit",
                 "-q", "-m", "course"]):  # fmt: skip
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


def test_a_release_is_the_commit_and_a_dirty_tree_is_refused_with_what_differs(tmp_path: Path) -> None:
    course = git_course(tmp_path / "course")
    (course / "labs" / "01_demo" / "demo.py").write_text("async def worker(env):\n    await env.do_it()\n")
    (course / "labs" / "01_demo" / "answer.py").write_text("the solution, never committed\n")
    (course / "solutions" / "01_demo" / "demo.py").write_text("changed, but solutions/ never ships\n")
    with pytest.raises(ReleaseError) as raised:
        build_edition(tmp_path / "out", course)
    said = str(raised.value)
    assert "differs from the last commit" in said and "in 2 file(s)" in said, said
    assert "modified: labs/01_demo/demo.py" in said and "untracked: labs/01_demo/answer.py" in said, said
    assert "--allow-dirty" in (raised.value.hint or "") and not (tmp_path / "out").exists()
    edition = build_edition(tmp_path / "out", course, allow_dirty=True)  # the commit, without the changes
    assert (tmp_path / "out" / "labs" / "01_demo" / "demo.py").read_text().endswith("...  # TODO: the work\n")
    assert not (tmp_path / "out" / "labs" / "01_demo" / "answer.py").exists()
    assert sorted(edition.not_shipped) == ["modified: labs/01_demo/demo.py", "untracked: labs/01_demo/answer.py"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=course, capture_output=True, text=True).stdout.strip()
    assert edition.source == head and f'from_commit = "{head}"' in (tmp_path / "out" / MARKER).read_text()


def test_a_graded_release_leaves_the_hints_code_level_out(tmp_path: Path) -> None:
    course = git_course(tmp_path / "course")
    build_edition(tmp_path / "graded", course)
    toml = (tmp_path / "graded" / "labs" / "01_demo" / "lab.toml").read_text()
    assert "env.do_it" not in toml and "env.once" not in toml and "code =" not in toml
    hints = tomllib.loads(toml)["hints"]
    assert hints == {"done": {"concept": "The idea, no code.", "lesson": "Part 1"}, "twice": {"concept": "Once."}}
    assert "code_hints = false" in (tmp_path / "graded" / MARKER).read_text()
    build_edition(tmp_path / "workshop", course, code_hints=True)  # a self-study edition keeps them
    assert "await env.do_it()  # the answer" in (tmp_path / "workshop" / "labs" / "01_demo" / "lab.toml").read_text()
    for lab in all_labs(ROOT):  # every lab of the course strips cleanly (a hint the parser could not drop stops it)
        stripped = tomllib.loads(strip_code_hints(committed(f"labs/{lab.name}/lab.toml").decode()))
        assert stripped["hints"] and not [h for h in stripped["hints"].values() if "code" in h], lab.name


def test_a_starter_that_passes_its_lab_stops_the_release(tmp_path: Path, no_nats_url: None) -> None:
    from msglab.classroom.sample import copy_course

    course = copy_course(tmp_path / "course", ["02_delivery_guarantees"], ROOT)
    lab = all_labs(course)[0]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit",
                 "-q", "-m", "course"]):  # fmt: skip
        subprocess.run(["git", *args], cwd=course, check=True, capture_output=True)
    build_edition(tmp_path / "honest", course, check_starters=True)  # the starter as committed fails: released
    (lab.folder / lab.file).write_bytes(lab.source(solution=True).read_bytes())  # a solution left in labs/
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "oops"], cwd=course,
                   check=True, capture_output=True)  # fmt: skip
    with pytest.raises(ReleaseError, match="lab 02: the starter passes") as raised:
        build_edition(tmp_path / "leaky", course, check_starters=True)
    assert "a solution may have been left in labs/" in (raised.value.hint or "")
    assert not (tmp_path / "leaky").exists()


def test_the_edition_has_a_readme_a_makefile_and_a_workflow_written_for_it(edition: Path) -> None:
    import yaml

    readme = (edition / "README.md").read_text()
    assert readme.startswith("# msglab") and "learner edition" in readme and "no reference solutions" in readme
    for absent in ("docs/", "solutions/", "--solution", "every lab has a reference solution", "For course developers"):
        assert absent not in readme, absent
    for link in re.findall(r"\]\(([^)]+)\)", readme):  # every link points into the edition
        assert (edition / link).exists(), link
    makefile = (edition / "Makefile").read_text()
    recipes = "\n".join(line for line in makefile.splitlines() if not line.startswith("#"))
    assert "ruff" not in recipes and "mypy" not in recipes and "scripts" not in recipes and "conftest" not in recipes
    assert "'pytest==" in makefile and "'nbval==" in makefile, "the course's pins"
    workflow = yaml.safe_load((edition / ".github" / "workflows" / "classroom.yml").read_text())
    steps = workflow["jobs"]["grade"]["steps"]
    graders = [step for step in steps if "autograding-command-grader" in step.get("uses", "")]
    labs = all_labs(edition)
    assert [g["with"]["command"] for g in graders] == [f"msglab check {lab.number}" for lab in labs]
    assert [g["with"]["max-score"] for g in graders] == [int(lab_points(lab).maximum) for lab in labs]
    reporter = steps[-1]
    assert reporter["with"]["runners"] == ",".join(g["id"] for g in graders)
    assert set(reporter["env"]) == {f"{g['id'].upper()}_RESULTS" for g in graders}
