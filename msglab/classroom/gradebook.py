"""`msglab grade SUBMISSIONS`: every learner's every lab, graded in parallel, into a gradebook.

Each (learner, lab) is one verdict of the ordinary grader (`msglab.grading.grade`), on a fresh
server of its own, with a seed derived from the learner id and the lab (`seed_for`), so grading
the same submissions again reproduces every verdict. What is graded is a folder built from the
instructor's course: the lab folder's own modules plus the learner's one file (see
msglab.classroom.submissions); lab.toml, the graders and everything else are the course's.

Jobs run on worker processes (msglab.classroom.worker) that import the graders once; each verdict's CPU (the
worker's, the server's, the learner processes') is measured in the worker.

Seeds are salted: a random salt by default, so learners cannot replay their graded faults before
the deadline, written to OUT/grading.json and printed; grading into the same OUT again reuses it.
Plans are keyed: a run's faults come from its seed and the class's plan key (msglab.grading.nemesis),
OUT/plan.key, made on the first grading into OUT and readable by the instructor's user alone; its id is
in grading.json. A regrade reproduces the verdicts where OUT/plan.key is the same (the same OUT, or a
copy of it on another machine); another key draws other faults from the same seeds.

Written to OUT:
    gradebook.csv              learner, lab, score, max, passed, failed, seed, seconds, status, note
    grades.csv                 one row per learner: name, sid, email (when the export has them), a column
                               per lab, the total and the maximum
    grading.json               the salt, the plan key's id, the labs, when
    plan.key                   the class's plan key (0600): a regrade elsewhere needs it
    feedback/<learner>.txt     every lab's verdict as text, with the command that replays it
    verdicts/<learner>/<lab>.json  the score and the verdict as JSON
    summary.txt                what the screen showed at the end
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import queue
import re
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from msglab.catalog import Lab, all_labs, course_root, find_lab
from msglab.classroom.points import LabPoints, Score, lab_points, number, same_code, score
from msglab.classroom.submissions import Found, Person, read_submissions
from msglab.errors import GraderError, MsglabError
from msglab.grading import nemesis
from msglab.grading.verdict import Verdict

SEED_RANGE = 999_999  # seeds are 1..999999, as msglab check draws them
READY_TIMEOUT = 120.0  # a worker imports the graders: seconds on a cold, busy machine
TASK_TIMEOUT = 240.0  # one verdict; the grader stops itself after about a minute whatever the learner does
CSV_FIELDS = ["learner", "lab", "score", "max", "passed", "failed", "seed", "seconds", "status", "note"]
PLAN_KEY = "plan.key"  # in OUT: the class's plan key


def seed_for(learner: str, lab: str, salt: str = "") -> int:
    """The seed of one learner's lab: the same learner id, lab and salt always give the same seed."""
    digest = hashlib.sha256(f"{salt}\0{learner}\0{lab}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_RANGE + 1


def safe_name(learner: str) -> str:
    """A learner id as a file name."""
    return re.sub(r"[^A-Za-z0-9._@+-]+", "_", learner).strip("._") or "learner"


@dataclass
class Row:
    """One learner's one lab in the gradebook."""

    learner: str
    lab: Lab
    seed: int | None
    where: str = ""
    result: Score | None = None
    verdict: Verdict | None = None
    seconds: float = 0.0
    cpu: float = 0.0

    @property
    def status(self) -> str:
        return self.result.status if self.result else "not graded"

    def csv(self) -> dict[str, str]:
        result = self.result
        assert result is not None
        return {
            "learner": self.learner,
            "lab": self.lab.number,
            "score": number(result.score),
            "max": number(result.maximum),
            "passed": "yes" if result.passed else "no",
            "failed": " ".join(result.failed),
            "seed": "" if self.seed is None else str(self.seed),
            "seconds": f"{self.seconds:.1f}",
            "status": result.status,
            "note": result.note,
        }


@dataclass
class ClassResult:
    """Everything one `msglab grade` produced."""

    rows: list[Row]
    out: Path
    jobs: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    startup_cpu: float = 0.0  # CPU the workers spent starting (Python, the graders' imports), once per job
    salt: str = ""
    people: dict[str, list[Person]] = field(default_factory=dict)  # learner -> submitters, when the export says
    plan_key: str = ""  # the id of the class's plan key (nemesis.key_id), as grading.json records it
    kept: frozenset[tuple[str, str]] = frozenset()  # (learner, lab) rows kept from an earlier grading into `out`

    @property
    def graded(self) -> list[Row]:
        return [row for row in self.rows if row.verdict is not None]

    @property
    def this_time(self) -> list[Row]:
        """The rows this run graded: a subset regrade's rows, without those it kept from `out`."""
        return [row for row in self.rows if (row.learner, row.lab.name) not in self.kept]

    @property
    def errors(self) -> list[Row]:
        return [row for row in self.rows if row.status == "grader error"]

    def cpu_per_verdict(self) -> float:
        graded = [row for row in self.this_time if row.verdict is not None]  # a kept row's CPU was spent earlier
        return sum(row.cpu for row in graded) / len(graded) if graded else 0.0


# --- the instructor's side ---------------------------------------------------------------------


JOBS_PER_CORE = 1


def default_jobs() -> int:
    """One job per core.

    Measured on 2 cores (`make bench`), 30 learners x 5 labs, 141 verdicts: 151 s with 2 jobs,
    78 s with 4 (a verdict waits on the grader's timers for most of its time, so `--jobs` above
    the cores pays while the machine has nothing else to do).
    """
    return max(1, JOBS_PER_CORE * (os.cpu_count() or 1))


def select_labs(spec: str | None) -> list[Lab]:
    """`--labs 01,02` (numbers or names), or every lab of the course."""
    if not spec:
        return all_labs()
    labs = [find_lab(key) for key in spec.split(",") if key.strip()]
    return list({lab.name: lab for lab in labs}.values())


def stage(found: Found, folder: Path) -> Path:
    """The folder a verdict grades: the course's own lab modules plus the learner's one file."""
    assert found.content is not None
    folder.mkdir(parents=True)
    for sibling in found.lab.folder.glob("*.py"):
        if sibling.is_file() and sibling.name != found.lab.file:
            shutil.copyfile(sibling, folder / sibling.name)
    target = folder / found.lab.file
    target.write_bytes(found.content)
    return target


def grade_class(
    submissions: Path,
    *,
    labs: list[Lab] | None = None,
    out: Path,
    jobs: int | None = None,
    salt: str | None = None,
    learners: list[str] | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    assignment: str = "",
    starter_behaviour: bool = False,
) -> ClassResult:
    """Grade every learner's every lab in `submissions`; write the gradebook, feedback and verdicts to `out`.

    assignment: GitHub Classroom's repository prefix (default: found from the repositories' names).
    salt: mixed into every seed; None: the one in OUT/grading.json, or a new random one.
    starter_behaviour: a failing file whose failed checks are the starter's on the same seed scores as the
    starter (the starter is graded once per such file: a file rewritten without changing what it does).
    It trusts a wrong file's verdict to be the same on every run of a seed, which lab 02's is not yet.
    """
    salted = salt is not None and salt != _saved_salt(out)  # a salt from elsewhere
    salt = salt if salt is not None else _saved_salt(out) or secrets.token_hex(6)
    stream = stream or sys.stderr
    started = time.perf_counter()
    labs = labs or all_labs()
    course_labs = all_labs()
    points = {lab.name: lab_points(lab) for lab in labs}
    starters = {lab.name: (lab.folder / lab.file).read_bytes() for lab in labs if (lab.folder / lab.file).is_file()}
    found = read_submissions(submissions, assignment)
    found.require_lab_files(labs, course_labs)  # a layout not understood stops here, before any verdict
    fresh = not os.path.lexists(out / PLAN_KEY)
    key = class_key(out)  # so does a plan key that would not reproduce the verdicts already in OUT
    ids = sorted(found.learners)
    if learners:
        missing = sorted(set(learners) - set(ids))
        ids = [learner for learner in ids if learner in learners]
        found.notes += [f"{learner}: no submission of that name" for learner in missing]
    jobs = max(1, jobs or default_jobs())
    rows: list[Row] = []
    pending: list[tuple[Row, Path, bool]] = []
    stage_root = Path(tempfile.mkdtemp(prefix="msglab-grade-"))
    try:
        for learner in ids:
            for lab in labs:
                file = found.find(learner, lab, course_labs)
                row = Row(learner, lab, seed_for(learner, lab.name, salt), file.where)
                rows.append(row)
                if file.content is None:
                    row.seed = None
                    row.result = Score(0.0, points[lab.name].maximum, False, [], "missing", file.problem)
                    continue
                source = stage(file, stage_root / safe_name(learner) / lab.name)
                pending.append((row, source, same_code(file.content, starters.get(lab.name, b""))))
        startup = _run(pending, points, jobs, progress, stream, out / "workers.log", key)
        if starter_behaviour:
            startup += _behaves_as_starter(pending, starters, points, jobs, stream, out, stage_root / "starters", key)
    finally:
        shutil.rmtree(stage_root, ignore_errors=True)
    graded = {(row.learner, row.lab.name) for row in rows}
    earlier = [row for row in earlier_rows(out) if (row.learner, row.lab.name) not in graded]
    notes = found.notes + ([f"kept {len(earlier)} earlier verdict(s) from {out} (not graded again this time)"]
                           if earlier else [])  # fmt: skip
    if salted and fresh:
        notes.append(f"a new plan key in {out / PLAN_KEY}: verdicts graded elsewhere with this salt are reproduced "
                     f"only with their --out's {PLAN_KEY} (copy it into --out before grading)")  # fmt: skip
    result = ClassResult(sorted(rows + earlier, key=lambda r: (r.learner, r.lab.name)), out, jobs,
                         time.perf_counter() - started, notes, startup, salt, found.people,
                         nemesis.key_id(key), frozenset((row.learner, row.lab.name) for row in earlier))  # fmt: skip
    write_outputs(result, points)
    return result


def earlier_rows(out: Path) -> list[Row]:
    """The rows an earlier `msglab grade` wrote into `out` (verdicts/<learner>/<lab>.json): a subset regrade keeps them.

    A lab no longer in the course, or a record that cannot be read, is left out.
    """
    rows = []
    for path in sorted(out.glob("verdicts/*/*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            lab = find_lab(record["lab"])
            verdict = Verdict.from_json(json.dumps(record["verdict"])) if record.get("verdict") else None
            failed = [check.name for check in verdict.failures] if verdict else []
            result = Score(record["score"], float(record["max"]), bool(record["passed"]), failed, record["status"],
                           record.get("note", ""))  # fmt: skip
            rows.append(Row(record["learner"], lab, record.get("seed"), record.get("where", ""), result, verdict,
                            float(record.get("seconds", 0.0)), float(record.get("cpu", 0.0))))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, MsglabError):
            continue
    return rows


def _behaves_as_starter(pending: list[tuple[Row, Path, bool]], starters: dict[str, bytes], points: dict[str, LabPoints],
                        jobs: int, stream: TextIO, out: Path, stage_root: Path, key: bytes) -> float:  # fmt: skip
    """Grade the starter on the seed of every failing row; a row whose failed checks are the starter's scores as it."""
    twins: list[tuple[Row, Path, bool]] = []
    rows: list[Row] = []
    for row, _, _ in pending:
        result = row.result
        if result is None or result.status != "graded" or result.passed or row.lab.name not in starters:
            continue
        starter = Found(row.learner, row.lab, starters[row.lab.name], "the starter")
        twin = Row(row.learner, row.lab, row.seed, "the starter")
        twins.append((twin, stage(starter, stage_root / safe_name(row.learner) / row.lab.name), False))
        rows.append(row)
    startup = _run(twins, points, jobs, False, stream, out / "workers.log", key)
    for row, (twin, _, _) in zip(rows, twins, strict=True):
        assert row.result is not None
        if twin.verdict is not None and twin.result and set(twin.result.failed) == set(row.result.failed):
            why = f"behaves as the starter on seed {row.seed}: the same checks fail"
            row.result = Score(points[row.lab.name].starter_points, row.result.maximum, False, row.result.failed,
                               "starter", why)  # fmt: skip
    return startup


def _saved_salt(out: Path) -> str:
    return _saved(out, "salt")


def _saved(out: Path, name: str) -> str:
    try:
        return str(json.loads((out / "grading.json").read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def class_key(out: Path) -> bytes:
    """The plan key of the class graded into `out`: OUT/plan.key, made on the first grading (0600, yours).

    Every verdict's faults come from its seed and this key, so a regrade reproduces them only under the
    same key: a key missing, unusable or not the one that graded the verdicts already in `out` stops here,
    before any verdict (a fresh key would silently give the class other faults).
    """
    path = out / PLAN_KEY
    recorded = _saved(out, "plan_key")
    again = "copy plan.key from the --out folder that graded them, or grade into a new --out"
    if not os.path.lexists(path):
        if recorded:
            raise MsglabError(f"{path} is missing, and the verdicts in {out} were graded under plan key {recorded}",
                              hint=again)  # fmt: skip
        if not out.exists():  # only the instructor reads it: learner code graded into it later must not read feedback
            out.mkdir(parents=True)
            out.chmod(0o700)
        return nemesis.plan_key(path)
    key = nemesis.read_key(path)
    if key is None:
        raise MsglabError(f"{path} is no plan key this user may use: it must be a regular file of "
                          f"{nemesis.KEY_BYTES} bytes, yours, that nobody else may read",
                          hint=f"chmod 600 {path} if it is the key that graded this class")  # fmt: skip
    if recorded and nemesis.key_id(key) != recorded:
        raise MsglabError(f"{path} is plan key {nemesis.key_id(key)}, but the verdicts in {out} were graded under "
                          f"plan key {recorded}", hint=again)  # fmt: skip
    return key


def _run(pending: list[tuple[Row, Path, bool]], points: dict[str, LabPoints], jobs: int, progress: bool,
         stream: TextIO, log: Path, key: bytes) -> float:  # fmt: skip
    """Grade every pending row on `jobs` workers; return the CPU the workers spent starting up."""
    if not pending:
        return 0.0
    from tqdm import tqdm

    # A bar on a terminal; in a log file (CI, nohup) a line each tenth of the way, or every 30 s.
    terminal = progress and stream.isatty()
    bar = tqdm(total=len(pending), unit="verdict", desc="grading", file=stream, disable=not terminal,
               dynamic_ncols=True)  # fmt: skip
    started, said, count = time.monotonic(), time.monotonic(), 0
    tasks: queue.Queue[int] = queue.Queue()
    for index in range(len(pending)):
        tasks.put(index)
    done: queue.Queue[Outcome] = queue.Queue()
    startup: list[float] = []
    with open(log, "a", encoding="utf-8") as log_file:
        threads = [
            threading.Thread(target=_serve, args=(pending, tasks, done, log_file, startup, key), daemon=True)
            for _ in range(min(jobs, len(pending)))
        ]
        for thread in threads:
            thread.start()
        for _ in range(len(pending)):
            index, outcome = done.get()
            row, source, starter = pending[index]
            _settle(row, outcome, points[row.lab.name], starter, source)
            if row.status == "grader error":
                bar.write(f"grader error: {row.learner} lab {row.lab.number}: {row.result.note if row.result else ''}")
            bar.update(1)
            count += 1
            step = max(1, len(pending) // 10)
            if (
                progress
                and not terminal
                and (count % step == 0 or count == len(pending) or time.monotonic() - said > 30)
            ):
                said = time.monotonic()
                print(f"grading: {count}/{len(pending)} verdicts in {said - started:.0f} s", file=stream, flush=True)
        for thread in threads:
            thread.join()
    bar.close()
    return sum(startup)


Outcome = tuple[int, dict[str, Any]]  # a pending row's index and what its worker answered


def _serve(pending: list[tuple[Row, Path, bool]], tasks: queue.Queue[int], done: queue.Queue[Outcome], log: TextIO,
           startup: list[float], key: bytes) -> None:  # fmt: skip
    """One job: a worker process fed one task at a time; a worker that dies or hangs is replaced."""
    worker: Worker | None = None
    try:
        while True:
            try:
                index = tasks.get_nowait()
            except queue.Empty:
                return
            row, source, _ = pending[index]
            if worker is None:
                try:
                    worker = Worker(log, key)
                    startup.append(worker.startup_cpu)
                except MsglabError as exc:
                    done.put((index, {"error": str(exc)}))
                    continue
            outcome = worker.grade(row.lab.name, str(source), row.seed or 0)
            if outcome is None:
                worker.stop()
                worker = None
                outcome = {"error": f"the grading worker died or hung (longer than {TASK_TIMEOUT:.0f} s)"}
            done.put((index, outcome))
    finally:
        if worker is not None:
            worker.stop()


class Worker:
    """One `python -m msglab.classroom.worker` process (see msglab.classroom.worker), grading under `key`."""

    def __init__(self, log: TextIO, key: bytes) -> None:
        # The key in the worker's environment, which only the instructor's user reads; its learner
        # processes are started without it (sandbox.LEARNER_ENV).
        env = {**os.environ, nemesis.KEY_VARIABLE: key.hex()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "msglab.classroom.worker", str(course_root())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        )  # fmt: skip
        ready = self._answer(READY_TIMEOUT)
        if ready is None or not ready.get("ready"):
            self.stop()
            raise GraderError(f"a grading worker did not start (its output is in {log.name})")
        self.startup_cpu = float(ready.get("cpu", 0.0))

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        try:
            return dict(json.loads(line)) if line else None
        except ValueError:
            return None

    def grade(self, lab: str, source: str, seed: int) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"lab": lab, "source": source, "seed": seed}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        return self._answer(TASK_TIMEOUT)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def relabel(verdict_json: str, source: Path, where: str) -> Verdict:
    """The verdict, naming the learner's file as they handed it in instead of the staged copy it graded."""
    return Verdict.from_json(verdict_json.replace(json.dumps(str(source))[1:-1], json.dumps(where)[1:-1]))


def _settle(row: Row, outcome: dict[str, Any], points: LabPoints, starter: bool, source: Path) -> None:
    row.seconds, row.cpu = float(outcome.get("seconds", 0.0)), float(outcome.get("cpu", 0.0))
    if "error" in outcome:
        row.result = Score(None, points.maximum, False, [], "grader error", str(outcome["error"]))
        return
    verdict = relabel(outcome["verdict"], source, row.where)
    row.verdict = verdict
    row.result = score(verdict, points, starter=starter)


# --- outputs -----------------------------------------------------------------------------------


def write_outputs(result: ClassResult, points: dict[str, LabPoints]) -> None:
    out = result.out
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    (out / "verdicts").mkdir(parents=True, exist_ok=True)
    with open(out / "gradebook.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, CSV_FIELDS)
        writer.writeheader()
        for row in result.rows:
            writer.writerow(row.csv())
    by_learner: dict[str, list[Row]] = {}
    for row in result.rows:
        by_learner.setdefault(row.learner, []).append(row)
    for learner, rows in by_learner.items():
        name = safe_name(learner)
        (out / "feedback" / f"{name}.txt").write_text(feedback_text(learner, rows), encoding="utf-8")
        folder = out / "verdicts" / name
        folder.mkdir(exist_ok=True)
        for row in rows:
            (folder / f"{row.lab.name}.json").write_text(json.dumps(verdict_record(row), indent=2) + "\n")
    (out / "summary.txt").write_text(summary_text(result) + "\n", encoding="utf-8")
    write_wide(result, out / "grades.csv")
    (out / "grading.json").write_text(json.dumps({
        "salt": result.salt, "plan_key": result.plan_key, "labs": sorted({row.lab.name for row in result.rows}),
        "graded": datetime.now().isoformat(timespec="seconds"),
    }, indent=2) + "\n")  # fmt: skip


def write_wide(result: ClassResult, path: Path) -> None:
    """One row per learner: who (when the export says), a column per lab, the total and the maximum."""
    labs = sorted({row.lab.number for row in result.rows})
    by_learner: dict[str, dict[str, Row]] = {}
    for row in result.rows:
        by_learner.setdefault(row.learner, {})[row.lab.number] = row
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["learner", "name", "sid", "email", *(f"lab {n}" for n in labs), "total", "max"])
        for learner, rows in by_learner.items():
            people = result.people.get(learner, [])
            scores = [rows[n].result if n in rows else None for n in labs]
            total = sum((s.score or 0.0) for s in scores if s is not None)
            maximum = sum(s.maximum for s in scores if s is not None)
            writer.writerow([learner, "; ".join(p.name for p in people), "; ".join(p.sid for p in people),
                             "; ".join(p.email for p in people), *(number(s.score) if s else "" for s in scores),
                             number(total), number(maximum)])  # fmt: skip


def verdict_record(row: Row) -> dict[str, Any]:
    """One verdict's JSON file: the learner, the score and the verdict itself."""
    assert row.result is not None
    return {
        "learner": row.learner,
        "lab": row.lab.name,
        "score": row.result.score,
        "max": row.result.maximum,
        "passed": row.result.passed,
        "status": row.result.status,
        "note": row.result.note,
        "seed": row.seed,
        "seconds": round(row.seconds, 2),
        "cpu": round(row.cpu, 3),
        "where": row.where,
        "verdict": json.loads(row.verdict.to_json()) if row.verdict else None,
    }


def feedback_text(learner: str, rows: list[Row]) -> str:
    """A learner's feedback: every lab's score and verdict, and how to replay it."""
    total = sum(row.result.score or 0.0 for row in rows if row.result)
    maximum = sum(row.result.maximum for row in rows if row.result)
    lines = [
        f"msglab feedback for {learner}, {datetime.now():%Y-%m-%d %H:%M}",
        f"total: {number(total)} of {number(maximum)} points",
        "",
    ]
    for row in rows:
        result = row.result
        assert result is not None
        lines.append(f"== lab {row.lab.number}: {row.lab.title}: {number(result.score) or '-'} of "
                     f"{number(result.maximum)} points ({result.status}) ==")  # fmt: skip
        if result.status == "missing":
            lines += [f"  {result.note}", f"  the file to hand in: labs/{row.lab.name}/{row.lab.file}", ""]
            continue
        if result.status == "grader error":
            lines += [f"  the grader failed on this lab (the course's fault, not yours): {result.note}",
                      "  your instructor will grade it again", ""]  # fmt: skip
            continue
        if result.status == "starter" and result.note.startswith("behaves"):
            lines.append(f"  {row.lab.file} {result.note}: nothing it does differs from the starter yet")
        elif result.status == "starter":
            lines.append(
                f"  {row.lab.file} runs the starter's code as handed out (comments and layout aside): "
                "nothing was changed yet"
            )
        elif result.note:
            lines.append(f"  {result.note}")
        assert row.verdict is not None
        lines.append(row.verdict.to_text())
        if row.verdict.passed:
            lines.append(f"  replay this exact run: {row.verdict.replay_command()}")
        lines.append("")
    lines.append(
        "The command under a lab replays its run where your class was graded: the faults come from the seed "
        "and your instructor's plan key. On your own machine the same command runs the same checks under "
        "other faults."
    )
    return "\n".join(lines) + "\n"


def summary_text(result: ClassResult) -> str:
    """The summary printed at the end: per lab, how the class did."""
    labs: dict[str, list[Row]] = {}
    for row in result.rows:
        labs.setdefault(row.lab.name, []).append(row)
    # The headline is this run's work (a subset regrade's, not the merged gradebook's): its time is this run's.
    now = result.this_time
    graded = [row for row in now if row.verdict is not None]
    lines = [
        f"graded {len({row.learner for row in now})} learners x {len({row.lab.name for row in now})} labs: "
        f"{len(graded)} verdicts in {result.seconds:.1f} s "
        f"with {result.jobs} jobs (CPU per verdict {result.cpu_per_verdict():.2f} s)",
        "",
        f"  {'lab':<34} {'passed':>8} {'mean':>12} {'missing':>8} {'starter':>8} {'errors':>7}",
    ]
    for name, rows in labs.items():
        scores = [row.result.score for row in rows if row.result and row.result.score is not None]
        maximum = rows[0].result.maximum if rows[0].result else 0.0
        mean = sum(scores) / len(scores) if scores else 0.0
        lines.append(
            f"  {name:<34} {sum(bool(r.result and r.result.passed) for r in rows):>3}/{len(rows):<4} "
            f"{mean:>6.1f}/{number(maximum):<5} {sum(r.status == 'missing' for r in rows):>8} "
            f"{sum(r.status == 'starter' for r in rows):>8} {sum(r.status == 'grader error' for r in rows):>7}"
        )
    for row in result.errors:
        lines.append(f"  grader error: {row.learner} lab {row.lab.number}: {row.result.note if row.result else ''}")
    lines += [f"  note: {note}" for note in result.notes]
    lines += [
        "",
        f"salt:      {result.salt} (saved in {result.out / 'grading.json'}; grading into the same --out reuses it, "
        f"or pass --salt {result.salt})",
        f"plan key:  {result.plan_key} ({result.out / PLAN_KEY}, yours alone: the faults of every verdict; a regrade "
        "elsewhere reproduces them with a copy of it in its --out)",
        f"gradebook: {result.out / 'gradebook.csv'}",
        f"grades:    {result.out / 'grades.csv'} (one row per learner, a column per lab)",
        f"feedback:  {result.out / 'feedback'}/ (one file per learner)",
        f"verdicts:  {result.out / 'verdicts'}/ (JSON per verdict)",
    ]
    return "\n".join(lines)
