"""`msglab grade`: points from lab.toml, submissions in every layout, and a generated class graded end to end.

The class is real: solutions, starters, known wrong variants, a file that does not import and a
missing one, graded by the real grader on real servers, in a course of two labs (a copy of the
instructor's, so that lab.toml can carry points while the labs' authors have not added them yet).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT
from msglab.catalog import all_labs, find_lab
from msglab.classroom import sample
from msglab.classroom.gradebook import Worker, class_key, grade_class, seed_for, summary_text
from msglab.classroom.points import LabPoints, lab_points, score
from msglab.classroom.sample import make_class
from msglab.classroom.submissions import MAX_BYTES, read_submissions
from msglab.errors import LabError, MsglabError
from msglab.grading import nemesis
from msglab.grading.verdict import Check, Verdict

LABS = ("01_request_reply_vs_events", "02_delivery_guarantees")


def copy_course(root: Path, labs: tuple[str, ...] = LABS) -> Path:
    """The instructor's course, these labs only: labs/, solutions/ and tests/variants/ of each."""
    return sample.copy_course(root, list(labs), ROOT)


@pytest.fixture
def course(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_nats_url: None) -> Path:
    root = copy_course(tmp_path / "course")
    sample.declare_points(root)  # until the labs' authors add [points] to lab.toml
    monkeypatch.setenv("MSGLAB_ROOT", str(root))
    return root


# --- points ------------------------------------------------------------------------------------


def write_lab(root: Path, toml: str) -> None:
    lab = root / "labs" / "01_demo"
    lab.mkdir(parents=True, exist_ok=True)
    (lab / "lab.toml").write_text(f'title = "A demo"\nfile = "demo.py"\n{toml}')
    (lab / "demo.py").write_text("async def worker(env):\n    ...\n")


def test_points_default_to_one_per_hinted_check_and_the_points_table_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSGLAB_ROOT", str(tmp_path))
    write_lab(tmp_path, '[hints.a]\nconcept = "x"\n[hints.b]\ncode = "y"\n[hints.file_imports]\nconcept = "z"\n'
                        "[points]\nb = 4\nc = 2.5\n[grading]\nstarter_points = 1\n")  # fmt: skip
    points = lab_points(find_lab("01"))
    # file_imports is no check of the lab; faults_fired and no_unplanned_deaths are on every verdict (rules 1, 3)
    assert points.points == {"a": 1.0, "b": 4.0, "c": 2.5, "faults_fired": 1.0, "no_unplanned_deaths": 1.0}
    assert points.maximum == 9.5 and points.starter_points == 1.0


@pytest.mark.parametrize(
    "toml, said",
    [
        ("[points]\na = -1\n", "points.a must be a number"),
        ('[points]\na = "two"\n', "points.a must be a number"),
        ("[points]\nfile_imports = 1\n", "file_imports is not a check of the lab"),
        ("[points]\na = 1\n[grading]\nstarter_points = 4\n", "more than the lab's maximum"),
    ],
)
def test_a_broken_points_table_is_named_with_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml: str, said: str
) -> None:
    monkeypatch.setenv("MSGLAB_ROOT", str(tmp_path))
    write_lab(tmp_path, toml)
    with pytest.raises(LabError, match=said) as raised:
        lab_points(find_lab("01"))
    assert "lab.toml" in str(raised.value)


def verdict(*checks: tuple[str, bool]) -> Verdict:
    return Verdict(lab="01_demo", graded="demo.py", seed=1, checks=[Check(n, n, ok, "seen") for n, ok in checks])


def test_a_score_is_the_points_of_the_checks_that_passed() -> None:
    points = LabPoints("01_demo", {"a": 3.0, "b": 1.0, "c": 1.0}, starter_points=1.0)
    assert score(verdict(("a", True), ("b", True), ("c", True)), points).score == 5.0
    partial = score(verdict(("a", True), ("b", False), ("c", True)), points)
    assert (partial.score, partial.maximum, partial.failed, partial.status) == (4.0, 5.0, ["b"], "graded")
    # A file that does not import scores 0 of the full maximum, not of the one check it ran.
    broken = score(verdict(("file_imports", False)), points)
    assert (broken.score, broken.maximum, broken.status) == (0.0, 5.0, "did not run")
    # An untouched starter scores what the instructor chose, whatever its checks did.
    starter = score(verdict(("a", True), ("b", True), ("c", False)), points, starter=True)
    assert (starter.score, starter.status) == (1.0, "starter")
    # A check lab.toml does not declare: a grader error in the row, not a score and not a crash.
    unknown = score(verdict(("a", True), ("surprise", True)), points)
    assert unknown.score is None and unknown.status == "grader error" and "surprise" in unknown.note
    assert score(verdict(("a", True)), LabPoints("01_demo")).status == "grader error"


def test_seeds_come_from_learner_and_lab_and_salt() -> None:
    assert seed_for("alice", "01_x") == seed_for("alice", "01_x")
    assert len({seed_for("alice", "01_x"), seed_for("bob", "01_x"), seed_for("alice", "02_y")}) == 3
    assert seed_for("alice", "01_x", salt="spring") != seed_for("alice", "01_x")
    assert all(1 <= seed_for(f"l{i}", "01_x") <= 999_999 for i in range(200))


# --- submissions -------------------------------------------------------------------------------


def test_every_layout_and_every_problem_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = copy_course(tmp_path / "course")
    monkeypatch.setenv("MSGLAB_ROOT", str(root))
    labs = all_labs()
    one, two = labs
    subs = tmp_path / "subs"
    files = {
        f"course/labs/{one.name}/{one.file}": b"course layout",
        f"course/labs/{one.name}/workers.py": b"not read",
        f"folders/{one.number}/{one.file}": b"lab number folder",
        f"folders/{two.name}/{two.file}": b"lab folder",
        f"bare/{one.file}": b"bare file",
        f"Ann Lee_4242_assignsubmission_file_/{one.file}": b"moodle",
        f"twice/a/{one.name}/{one.file}": b"one",
        f"twice/b/{one.name}/{one.file}": b"other",
        f"big/{one.file}": b"x" * (MAX_BYTES + 1),
        f"ckpt/.ipynb_checkpoints/{one.file}": b"a checkpoint, not a submission",
        f"leelee_LATE_17_99_{one.file.replace('.py', '-1.py')}": b"canvas, resubmitted",
    }
    for name, content in files.items():
        (subs / name).parent.mkdir(parents=True, exist_ok=True)
        (subs / name).write_bytes(content)
    (subs / "link").mkdir()
    (subs / "link" / one.file).symlink_to(ROOT / "solutions" / one.name / one.file)  # a learner's "submission"
    found = read_submissions(subs)

    def get(learner: str, lab: object = one) -> tuple[bytes | None, str]:
        hit = found.find(learner, lab, labs)  # type: ignore[arg-type]
        return hit.content, hit.problem

    assert get("course") == (b"course layout", "")
    assert get("folders") == (b"lab number folder", "")
    assert get("folders", two) == (b"lab folder", "")
    assert get("bare") == (b"bare file", "")
    assert get("Ann Lee_4242") == (b"moodle", "")
    assert get("leelee_17") == (b"canvas, resubmitted", "")
    assert get("bare", two)[1].startswith("missing: no invoices.py")
    assert get("twice")[1].startswith("ambiguous")
    assert "too large" in get("big")[1]
    assert get("ckpt")[1].startswith("missing")
    assert "symbolic link" in get("link")[1]

    # The same class as a platform's zip, inside a wrapper folder: the same answers, nothing extracted.
    archive = tmp_path / "export.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, content in files.items():
            zf.writestr(f"export-2026/{name}", content)
        zf.writestr("export-2026/../../escape.py", b"never a learner")
    found = read_submissions(archive)
    assert get("course") == (b"course layout", "")
    assert get("Ann Lee_4242") == (b"moodle", "")
    assert get("leelee_17") == (b"canvas, resubmitted", "")
    assert get("twice")[1].startswith("ambiguous")
    assert not any(".." in learner for learner in found.learners)


# --- a class, end to end -----------------------------------------------------------------------


def test_a_generated_class_is_graded_end_to_end_with_the_right_scores(course: Path, tmp_path: Path) -> None:
    manifest = make_class(tmp_path / "class", learners=6)
    kinds = {entry["kind"].split(":")[0] for learner in manifest.values() for entry in learner["labs"].values()}
    assert kinds == {"solution", "also_right", "starter", "missing", "broken", "wrong"}, kinds
    out = tmp_path / "grades"
    result = grade_class(tmp_path / "class", out=out, jobs=2, progress=False)
    points = {lab.name: lab_points(lab) for lab in all_labs()}
    rows = {(row.learner, row.lab.name): row for row in result.rows}
    assert len(rows) == 12 and not result.errors, summary_text(result)
    assert out.stat().st_mode & 0o077 == 0  # other users (a later run's learner code) cannot list or read it
    for learner, entry in manifest.items():
        for lab, expected in entry["labs"].items():
            row, full = rows[(learner, lab)], points[lab].maximum
            assert row.result is not None
            kind, got, text = expected["kind"].split(":")[0], row.result, row.verdict.to_text() if row.verdict else ""
            assert got.maximum == full, (learner, lab)
            if kind in ("solution", "also_right"):
                assert (got.status, got.score, got.passed) == ("graded", full, True), (learner, lab, text)
            elif kind == "starter":
                assert (got.status, got.score) == ("starter", points[lab].starter_points), (learner, lab)
            elif kind == "missing":
                assert (got.status, got.score, row.seed) == ("missing", 0.0, None) and "missing" in got.note
            elif kind == "broken":
                assert (got.status, got.score) == ("did not run", 0.0) and "file_imports" in got.failed
                assert "did not import" in got.note and "/tmp/msglab-grade-" not in text  # names the learner's file
            else:
                assert row.verdict is not None and got.status == "graded" and not got.passed
                assert set(expected["must_fail"]) <= set(got.failed), (learner, lab, text)
                # The passed checks' points; while a `requires` check failed, only the passed `requires` ones.
                passed = {c.name for c in row.verdict.checks if c.passed}
                gate = points[lab].requires
                earning = set(points[lab].points) if set(gate) <= passed else set(gate)
                earned = sum(points[lab].points[name] for name in passed & earning)
                assert got.score == earned < full, (learner, lab)

    with open(out / "gradebook.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == ["learner", "lab", "score", "max", "passed", "failed", "seed", "seconds", "status", "note"]
    assert len(table) == 12
    wrong = next(row for row in result.rows if row.result and row.result.status == "graded" and not row.result.passed)
    feedback = (out / "feedback" / f"{wrong.learner}.txt").read_text()
    assert f"replay this exact run: msglab check {wrong.lab.number} --seed {wrong.seed}" in feedback
    assert f"lab {wrong.lab.number}" in feedback and "points" in feedback
    record = json.loads((out / "verdicts" / wrong.learner / f"{wrong.lab.name}.json").read_text())
    assert record["seed"] == wrong.seed and record["verdict"]["seed"] == wrong.seed
    assert (out / "summary.txt").read_text().startswith("graded 6 learners x 2 labs")

    # A regrade elsewhere (the salt, and the class's plan key copied into its --out) reproduces the verdicts
    # exactly: same seeds, same faults, same checks failed, same scores.
    (tmp_path / "again").mkdir()
    shutil.copy(out / "plan.key", tmp_path / "again" / "plan.key")
    again = grade_class(tmp_path / "class", out=tmp_path / "again", jobs=2, progress=False, learners=[wrong.learner],
                        salt=result.salt)  # fmt: skip
    assert again.plan_key == result.plan_key == json.loads((out / "grading.json").read_text())["plan_key"]
    for row in again.rows:
        first = rows[(row.learner, row.lab.name)]
        assert (row.seed, row.result and row.result.score, row.result and row.result.failed) == (
            first.seed, first.result.score if first.result else None, first.result.failed if first.result else None
        )  # fmt: skip


def test_a_class_has_a_plan_key_of_its_own_that_a_regrade_elsewhere_needs(tmp_path: Path) -> None:
    out, other, elsewhere = tmp_path / "out", tmp_path / "other", tmp_path / "elsewhere"
    key = class_key(out)
    info = (out / "plan.key").stat()
    assert (info.st_mode & 0o777, info.st_uid) == (0o600, os.geteuid())  # the instructor's alone
    assert class_key(out) == key  # grading into the same --out again: the same faults

    def plan(key: bytes) -> int:  # the plan a worker draws for seed 7 (it grades under key.hex())
        return nemesis.plan_seed(7, nemesis.key_from_text(key.hex()))

    assert plan(class_key(other)) != plan(key)  # another class, the same seed: other faults
    (out / "grading.json").write_text(json.dumps({"salt": "s", "plan_key": nemesis.key_id(key)}))
    elsewhere.mkdir()
    shutil.copy(out / "grading.json", elsewhere)  # the verdicts' record, without their key
    with pytest.raises(MsglabError, match="missing, and the verdicts"):
        class_key(elsewhere)
    shutil.copy(other / "plan.key", elsewhere)
    with pytest.raises(MsglabError, match="were graded under plan key"):
        class_key(elsewhere)
    shutil.copy(out / "plan.key", elsewhere)  # its mode travels with it
    assert class_key(elsewhere) == key
    (elsewhere / "plan.key").chmod(0o644)
    with pytest.raises(MsglabError, match="nobody else may read"):
        class_key(elsewhere)


def test_a_grading_worker_grades_under_the_class_key(tmp_path: Path) -> None:
    key = class_key(tmp_path / "out")
    with open(tmp_path / "workers.log", "w") as log:
        worker = Worker(log, key)
        try:
            environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes().split(b"\0")
        finally:
            worker.stop()
    assert f"{nemesis.KEY_VARIABLE}={key.hex()}".encode() in environ


def test_the_grade_command_names_a_missing_folder_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from msglab.classroom.submissions import SubmissionsError

    with pytest.raises(SubmissionsError, match="does not exist"):
        read_submissions(tmp_path / "nowhere")
    not_a_zip = tmp_path / "grades.txt"
    not_a_zip.write_text("hello")
    with pytest.raises(SubmissionsError, match="neither a folder nor a zip"):
        read_submissions(not_a_zip)
    done = cli(["grade", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr


# The msglab CLI with the classroom commands registered (as msglab.cli does once it calls register).
CLI_DRIVER = """
import argparse, sys
from msglab import cli
from msglab.classroom.commands import register
build = cli.build_parser
def parser():
    p = build()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    if "grade" not in sub.choices:
        register(sub)
    return p
cli.build_parser = parser
sys.exit(cli.main(sys.argv[1:]))
"""


def cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `msglab ARGS` with the classroom commands, as a terminal would."""
    full = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", CLI_DRIVER, *args], capture_output=True, text=True, env=full,
                          cwd=ROOT, timeout=600)  # fmt: skip


def test_the_instructor_guide_lists_every_wrong_variant() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "mistakes.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, (
        "docs/instructors.md's common mistakes are out of step with tests/variants/: "
        f"run `.venv/bin/python scripts/mistakes.py` ({done.stderr.strip()})"
    )
