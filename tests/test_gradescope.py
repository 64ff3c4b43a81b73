"""The Gradescope autograder: results.json in Gradescope's format, and the bundle's scripts run for real.

The platform is imitated by a scratch folder laid out as Gradescope lays out its image:
AUTOGRADER_ROOT/source (the unzipped bundle; setup.sh runs there, offline, from the bundle's
wheels), AUTOGRADER_ROOT/submission (the learner's files), AUTOGRADER_ROOT/results. The course is
installed into the image's venv NOT editable, so it is found through MSGLAB_ROOT alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from msglab.catalog import find_lab
from msglab.classroom.gradescope import build_bundle, fetch_wheels, grader_requirements, results_json
from msglab.classroom.points import LabPoints, Score, lab_points
from msglab.classroom.sample import points_table
from msglab.grading.verdict import Check, Verdict

WHEELS = ROOT / "var" / "test-wheels"


def grader_wheels(python: str | None = None) -> Path:
    """The grader's wheels for this machine (for Python `python`, e.g. '3.13'; default this one), downloaded once
    and kept in var/ (keyed by the pins and the version: aiohttp's wheels are built per Python)."""
    pins = grader_requirements()
    folder = WHEELS / hashlib.sha256("\n".join([*pins, python or ""]).encode()).hexdigest()[:12]
    if not folder.is_dir():
        WHEELS.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix="partial-", dir=WHEELS))
        fetch_wheels(partial, pins, python=python)
        try:
            partial.rename(folder)  # atomic: a parallel worker that got there first wins
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


def test_results_json_has_gradescopes_fields_and_adds_up() -> None:
    lab = find_lab("01")
    points = LabPoints(lab.name, {"a": 3.0, "b": 1.0, "faults_fired": 1.0}, starter_points=0.0)
    verdict = Verdict(lab.name, "orders.py", seed=42, checks=[
        Check("a", "every order is emailed", True),
        Check("b", "no order is emailed twice", False, "o-3 was emailed twice", ["+0.1s deliver o-3"], "ack after"),
        Check("faults_fired", "every planned crash happened", True),
    ])  # fmt: skip
    records = [
        {"lab": lab, "points": points, "seed": 42, "verdict": verdict,
         "result": Score(4.0, 5.0, False, ["b"], "graded")},
        {"lab": lab, "points": points, "seed": 7, "verdict": None,
         "result": Score(0.0, 5.0, False, [], "missing", "missing: no orders.py in the submission")},
    ]  # fmt: skip
    results = results_json(records, visibility="after_due_date", seconds=3.2)
    assert results["score"] == 4.0 and results["execution_time"] == 3
    assert "msglab check 01 --seed 42" in results["output"] and "missing: no orders.py" in results["output"]
    for test in results["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output", "visibility", "number"}
        sanity = test["number"].endswith(".0")  # whether the file was found and ran: always visible
        assert test["visibility"] == ("visible" if sanity else "after_due_date")
    failed = next(t for t in results["tests"] if t["name"] == "lab 01 · b")  # by check id: stable
    assert (failed["score"], failed["max_score"], failed["status"]) == (0.0, 1.0, "failed")
    assert failed["output"].startswith("no order is emailed twice")
    assert "o-3 was emailed twice" in failed["output"] and "hint: ack after" in failed["output"]
    # Every lab's tests have the same names and numbers whatever happened; the sanity test is always visible.
    graded, missing = (results["tests"][i * 4 : i * 4 + 4] for i in range(2))
    assert (
        [t["name"] for t in graded]
        == [t["name"] for t in missing]
        == ["lab 01 · orders.py found, runs, and is your own", "lab 01 · a", "lab 01 · b", "lab 01 · faults fired"]
    )
    assert [t["number"] for t in graded] == ["01.0", "01.1", "01.2", "01.3"]
    assert graded[0]["visibility"] == missing[0]["visibility"] == "visible"
    assert (graded[0]["status"], missing[0]["status"]) == ("passed", "failed")
    assert sum(t["score"] for t in results["tests"]) == results["score"]
    json.dumps(results)  # plain JSON


@pytest.fixture
def platform() -> Iterator[Path]:
    """A scratch AUTOGRADER_ROOT others may traverse (graded code runs as a user of its own, as on the platform)."""
    root = Path(tempfile.mkdtemp(prefix="msglab-gradescope-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_autograder_bundle_runs_in_a_platform_shaped_folder(
    platform: Path, tmp_path: Path, no_nats_url: None
) -> None:
    lab = find_lab("01")
    archive = build_bundle(tmp_path / "bundle", [lab], wheelhouse=grader_wheels())
    source = platform / "source"
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(source)
    for script in ("setup.sh", "run_autograder"):  # zip keeps the executable bits; extractall does not
        (source / script).chmod(0o755)
    toml = source / "course" / "labs" / lab.name / "lab.toml"
    if not lab_points(lab).points:  # until the lab's authors add [points] to lab.toml
        toml.write_text(toml.read_text() + points_table(lab.number))
    assert not (source / "course" / "solutions").exists() and not (source / "course" / "tests").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "MSGLAB_ROOT", "VIRTUAL_ENV")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", AUTOGRADER_ROOT=str(platform))  # offline: bundle only
    setup = subprocess.run(["bash", "setup.sh"], cwd=source, env=env, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    config = source / "msglab-autograder.json"  # the salt and the class's plan key: the grader's alone
    assert len(json.loads(config.read_text())["plan_key"]) == 64 and config.stat().st_mode & 0o077 == 0
    where = subprocess.run([str(source / "venv" / "bin" / "python"), "-c", "import msglab; print(msglab.__file__)"],
                           cwd="/", env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert "/venv/lib/" in where.stdout, "the course is installed into the image, not editable"
    shutil.copy(source / "run_autograder", platform / "run_autograder")

    def submit(content: bytes, learner_id: str) -> dict[str, Any]:
        submission = platform / "submission"
        shutil.rmtree(submission, ignore_errors=True)
        (submission / "nested").mkdir(parents=True)
        (submission / "nested" / lab.file).write_bytes(content)
        (submission / "nested" / "lab.toml").write_text('title = "forged"\nfile = "orders.py"\n[points]\nx = 100\n')
        (platform / "submission_metadata.json").write_text(json.dumps({"users": [{"id": learner_id}]}))
        shutil.rmtree(platform / "results", ignore_errors=True)
        run = subprocess.run([str(platform / "run_autograder")], cwd=platform, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        return dict(json.loads((platform / "results" / "results.json").read_text()))

    solved = submit(lab.source(solution=True).read_bytes(), "4242")
    tests = solved["tests"]
    assert isinstance(tests, list) and tests
    maximum = sum(t["max_score"] for t in tests)
    assert solved["score"] == maximum > 0, solved["output"]
    assert all(t["status"] == "passed" for t in tests), [t["name"] for t in tests if t["status"] != "passed"]
    assert "forged" not in json.dumps(solved) and maximum < 100, "the submission's lab.toml is never read"

    variant = ROOT / "tests" / "variants" / lab.name / "never_acks.py"
    wrong = submit(variant.read_bytes(), "4243")
    assert 0 < float(wrong["score"]) < maximum
    failing = [t for t in wrong["tests"] if t["status"] == "failed"]
    assert failing and all(t["output"] for t in failing)
    assert "replay this exact run: msglab check 01 --seed" in str(wrong["output"])

    missing = platform / "submission"
    shutil.rmtree(missing)
    missing.mkdir()
    run = subprocess.run([str(platform / "run_autograder")], cwd=platform, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    nothing = json.loads((platform / "results" / "results.json").read_text())
    assert run.returncode == 0 and nothing["score"] == 0 and "missing: no orders.py" in nothing["output"]


def test_results_json_is_written_even_when_grading_itself_fails(tmp_path: Path) -> None:
    from msglab.classroom.gradescope import main

    (tmp_path / "config.json").write_text('{"labs": ["no_such_lab"]}')
    results = tmp_path / "results" / "results.json"
    assert main(["--submission", str(tmp_path), "--results", str(results), "--config", str(tmp_path / "config.json"),
                 "--metadata", str(tmp_path / "none.json")]) == 0  # fmt: skip
    written = json.loads(results.read_text())
    assert written["score"] == 0.0 and "could not grade this submission (not your fault" in written["output"]
    (tmp_path / "config.json").write_text("{not json")
    assert (
        main(["--submission", str(tmp_path), "--results", str(results), "--config", str(tmp_path / "config.json")]) == 0
    )
    assert "could not grade" in json.loads(results.read_text())["output"]
