"""Tricks on the grader's own side of a run (issue 15), each beside its control (the same wrong file
without the trick): a run cannot read another run's submission or list the runs, and a file that
blocks the grader (a FIFO where it reads a file) fails within the verdict's deadline, never hangs it."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import PRELUDE, mark_folder
from grader_side import FIFO_FOR_THE_DATABASE, OUTSIDE_PROBE, READ_ANOTHER_RUN, READ_THROUGH_A_SIBLING, REBUILD_THE_PLAN

from msglab.catalog import Lab, all_labs
from msglab.grading.grade import DEADLINE, grade
from msglab.grading.harness import RUN_PREFIX, runs_folder
from msglab.grading.sandbox import UID_RANGE, Sandbox
from msglab.grading.verdict import Verdict

OWN_USER = Sandbox.for_this_machine().uid is not None
LABS = {lab.number: lab for lab in all_labs()}


@pytest.fixture
def mark() -> Iterator[Path]:
    """A folder outside the run where the hostile code leaves what it saw."""
    folder = mark_folder("msglab-grader-side-")
    yield folder
    for name in os.listdir(folder):
        os.unlink(folder / name)
    folder.rmdir()


def _graded(lab: Lab, mark: Path, trick: str = "", seed: int = 1) -> Verdict:
    folder = Path(tempfile.mkdtemp(prefix="msglab-grader-side-src-"))
    path = folder / lab.file
    path.write_text(lab.source(solution=False).read_text() + PRELUDE.format(mark=str(mark)) + trick)
    try:
        return grade(lab.number, source=path, seed=seed)
    finally:
        path.unlink()
        folder.rmdir()


def _said(mark: Path) -> list[str]:
    return [(mark / n).read_text() for n in sorted(os.listdir(mark)) if not n.endswith(".part")]


def _failed(verdict: Verdict) -> list[str]:
    return [check.name for check in verdict.failures]


@pytest.mark.skipif(
    not OWN_USER, reason="runs of one user are that user's: only a user of its own per run separates them"
)
def test_two_runs_at_once_cannot_read_each_others_submission_or_list_the_runs(no_nats_url: None, mark: Path) -> None:
    control = _graded(LABS["01"], mark)  # the starter fails for its own mistakes
    for name in os.listdir(mark):
        os.unlink(mark / name)
    verdicts: list[Verdict] = []
    outside: dict[str, str] = {}

    def probe_from_outside() -> None:
        """A third user, in no run's private /tmp: it knows both runs' paths, lists and reads nothing."""
        import time

        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            sources = [w[len("source ") :] for w in _said(mark) if w.startswith("source ")]
            if len(sources) == 2:
                break
            time.sleep(0.05)
        else:
            return
        uid = secrets.SystemRandom().randint(*UID_RANGE)
        command = [sys.executable, "-I", "-c", OUTSIDE_PROBE, *sources]
        done = subprocess.run(command, user=uid, group=uid, extra_groups=[], capture_output=True, text=True,
                              timeout=30, cwd="/")  # fmt: skip
        outside.update(json.loads(done.stdout or "{}"))

    threads = [threading.Thread(target=lambda: verdicts.append(_graded(LABS["01"], mark, READ_ANOTHER_RUN)))
               for _ in range(2)]  # fmt: skip
    threads.append(threading.Thread(target=probe_from_outside))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(verdicts) == 2 and not any(v.passed for v in verdicts)
    assert sorted(_failed(verdicts[0])) == sorted(_failed(control)) or not verdicts[0].passed
    tried = [json.loads(w[len("tried ") :]) for w in _said(mark) if w.startswith("tried ")]
    assert tried, _said(mark)
    for attempt in tried:
        assert attempt["own"].startswith("read "), attempt  # the control: a run reads its own source
        assert attempt["others"] == 1 and attempt["other"].startswith("refused"), attempt
        listed = attempt["runs"].split()[-1].split(",") if attempt["runs"].startswith("listed") else []
        assert len(listed) <= 1, attempt  # at most its own folder, in its private /tmp
    assert outside, "the outside probe never saw two runs at once"
    assert all(v.startswith("refused") for v in outside.values()), outside
    assert Path(runs_folder()).stat().st_mode & 0o777 == 0o711


def test_a_fifo_in_place_of_the_database_fails_within_the_deadline(no_nats_url: None, mark: Path) -> None:
    control = _graded(LABS["03"], mark)
    assert not control.passed and "finishes" not in _failed(control), control.to_text()
    verdict = _graded(LABS["03"], mark, FIFO_FOR_THE_DATABASE)
    assert "swapped" in _said(mark), _said(mark)  # the trick happened
    assert not verdict.passed, verdict.to_text()
    assert verdict.seconds < DEADLINE, verdict.to_text()
    assert not list(Path(runs_folder()).glob(f"{RUN_PREFIX}{os.getpid()}-*")), "the run left its folder"


def _rebuilt(mark: Path) -> dict[str, Any]:
    return json.loads(next(w for w in _said(mark) if w.startswith("plan "))[len("plan ") :])


def test_a_plan_rebuilt_from_the_seed_is_not_the_graders(
    no_nats_url: None, mark: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from msglab.graders import delivery_guarantees
    from msglab.grading import nemesis

    seed, drawn = 424242, []
    real = delivery_guarantees.Plan.draw.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, plan_seed: int) -> Any:
        drawn.append(plan_seed)
        return real(cls, plan_seed)

    monkeypatch.setattr(delivery_guarantees.Plan, "draw", classmethod(spy))
    trick = REBUILD_THE_PLAN.replace("SEED", str(seed))

    def graders_draws(plan_seed: int) -> list[float]:
        return [nemesis.rng(plan_seed, s).random() for s in ("crash_order", "crash_calls", "final_order", "outage")]

    # The control: plans from the seed alone, as before keys. The learner's process rebuilds the grader's exactly.
    with monkeypatch.context() as unkeyed:
        unkeyed.setattr(nemesis, "plan_seed", lambda seed: seed)
        assert not _graded(LABS["02"], mark, trick, seed=seed).passed
    assert drawn == [seed] and _rebuilt(mark)["draws"] == graders_draws(seed)
    for name in os.listdir(mark):
        os.unlink(mark / name)
    drawn.clear()
    # Keyed: the same seed replays the same plan on this installation, and the learner's rebuild is wrong.
    assert not _graded(LABS["02"], mark, trick, seed=seed).passed
    seen = _rebuilt(mark)
    assert drawn == [nemesis.plan_seed(seed)] and drawn[0] != seed
    assert seen["draws"] != graders_draws(drawn[0])
    assert seen["carried"] == [], seen  # no grading process's argv or environment carries the seed
    if OWN_USER:
        assert seen["key"].startswith("refused"), seen


@pytest.mark.skipif(not OWN_USER, reason="as the grader's own user, a file it may read the learner may read anyway")
def test_a_sibling_symlink_to_a_graders_file_is_not_copied_into_the_run(no_nats_url: None, mark: Path) -> None:
    lab = LABS["01"]
    private = Path(tempfile.mkdtemp(prefix="msglab-grader-only-"))  # 0700, the grader's: no learner reads it
    (private / "grader_secret.py").write_text('SECRET = "the grader\'s own"\n')
    folder = Path(tempfile.mkdtemp(prefix="msglab-grader-side-src-"))
    try:
        (folder / lab.file).write_text(
            lab.source(solution=False).read_text() + PRELUDE.format(mark=str(mark)) + READ_THROUGH_A_SIBLING
        )
        (folder / "grader_secret.py").symlink_to(private / "grader_secret.py")
        verdict = grade(lab.number, source=folder / lab.file, seed=1)
    finally:
        for path in (*folder.iterdir(), *private.iterdir()):
            path.unlink()
        folder.rmdir()
        private.rmdir()
    assert not verdict.passed
    outcomes = [w for w in _said(mark) if w.startswith("outcome ")]
    assert outcomes and all(w.startswith("outcome refused") for w in outcomes), outcomes


# --- keyed plans (issue 15: "the fault plan from the command line") -------------------------------


def test_one_seed_under_two_keys_draws_two_plans_and_the_seed_alone_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    from msglab.graders import delivery_guarantees, request_reply_vs_events
    from msglab.grading import nemesis

    seeds = range(1, 21)

    def keyed(text: str) -> list[int]:
        monkeypatch.setenv(nemesis.KEY_VARIABLE, text)
        return [nemesis.plan_seed(seed) for seed in seeds]

    first, again, other = keyed("key a"), keyed("key a"), keyed("key b")
    assert first == again  # one key, one seed: one plan (a replay)
    for grader in (request_reply_vs_events, delivery_guarantees):
        plans = [grader.Plan.draw(k) for k in first]
        assert not any(p == grader.Plan.draw(k) for p, k in zip(plans, other, strict=True)), grader.__name__
        assert not any(p == grader.Plan.draw(seed) for p, seed in zip(plans, seeds, strict=True)), grader.__name__


def test_the_key_file_is_the_graders_alone_and_a_planted_one_is_never_used(tmp_path: Path) -> None:
    from msglab.grading import nemesis

    path = tmp_path / "var" / "plan.key"
    key = nemesis.plan_key(path)
    info = path.stat()
    assert (info.st_mode & 0o777, info.st_uid, len(key)) == (0o600, os.geteuid(), nemesis.KEY_BYTES)
    nemesis._keys.pop(path)
    assert nemesis.plan_key(path) == key  # read again, not made again: replays keep their plans
    path.chmod(0o644)  # readable by others: it may have been read, or planted
    nemesis._keys.pop(path)
    assert nemesis.plan_key(path) != key and path.stat().st_mode & 0o777 == 0o600


READ_A_FILE = """
import sys
try:
    open(sys.argv[1], "rb").read()
    print("read")
except OSError as exc:
    print("refused", type(exc).__name__)
"""


@pytest.mark.skipif(not OWN_USER, reason="as the grader's own user, learner code may read the grader's files anyway")
def test_a_learners_user_cannot_read_the_installations_key_file(mark: Path) -> None:
    from msglab.grading import nemesis

    nemesis.plan_key(nemesis.key_file())  # made on first use, if no grading made it yet
    readable = mark / "readable"
    readable.write_bytes(b"x")
    readable.chmod(0o644)
    uid = secrets.SystemRandom().randint(*UID_RANGE)

    def read(path: Path) -> str:
        done = subprocess.run([sys.executable, "-I", "-c", READ_A_FILE, str(path)], user=uid, group=uid,
                              extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/")  # fmt: skip
        return done.stdout.strip() or done.stderr

    assert read(readable) == "read"  # the control: that user reads what it may
    assert read(nemesis.key_file()) == "refused PermissionError"
    readable.unlink()


# Reports the orders lab 01's grader hands place_order (drawn from the run's plan), and what a learner
# process finds of the seed and the key: in any process's command line, in any environment it may read.
SEE_THE_PLAN = """
import json as _json

_placed = place_order


async def place_order(env, order):
    import ctypes

    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, as an attacker would: its own environ is readable
    seen = {"order": order, "env": sorted(n for n in _os.environ if "KEY" in n or "SEED" in n)}
    seen.update(seed=[], decoy=[], grader=0, environs=0, secret=[])
    for pid in filter(str.isdigit, _os.listdir("/proc")):
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:  # gone
            continue
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:  # another user's
            environ = None
        seen["seed"] += [pid] if b"@SEED@" in words else []
        seen["decoy"] += [pid] if b"@DECOY@" in words else []
        seen["grader"] += b"msglab" in words and b"check" in words
        if environ is not None:
            seen["environs"] += 1
            seen["secret"] += [pid] if b"@SEED@" in environ or b"@KEYTEXT@" in environ else []
    _report("saw " + _json.dumps(seen))
    return await _placed(env, order)
"""


def test_msglab_check_keeps_the_seed_off_every_command_line_and_replays_its_plan(tmp_path: Path, mark: Path) -> None:
    from conftest import ROOT, run_cli
    from msglab.graders.request_reply_vs_events import Plan
    from msglab.grading import nemesis

    seed, decoy, text = 864213, 864214, f"keytext-{secrets.token_hex(8)}"
    lab = LABS["01"]
    course = tmp_path / "course"
    for folder in ("labs", "solutions"):
        shutil.copytree(
            ROOT / folder / lab.name, course / folder / lab.name, ignore=shutil.ignore_patterns("__pycache__")
        )
    source = course / "labs" / lab.name / lab.file
    trick = SEE_THE_PLAN.replace("@DECOY@", str(decoy)).replace("@SEED@", str(seed)).replace("@KEYTEXT@", text)
    source.write_text(source.read_text() + PRELUDE.format(mark=str(mark)) + trick)
    # The control: a process with a number on its command line, which learner code must see.
    waiting = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", str(decoy)], stdin=subprocess.PIPE
    )
    runs = []
    try:
        for _ in range(2):  # the same seed twice: a replay
            done = run_cli("check", lab.number, "--seed", str(seed), "--json", "--no-attempt",
                           env={"MSGLAB_ROOT": str(course), nemesis.KEY_VARIABLE: text})  # fmt: skip
            assert done.returncode == 1 and json.loads(done.stdout)["seed"] == seed, done.stdout + done.stderr
            runs.append([json.loads(w[len("saw ") :]) for w in _said(mark) if w.startswith("saw ")])
            for name in os.listdir(mark):
                os.unlink(mark / name)
    finally:
        assert waiting.stdin is not None
        waiting.stdin.close()
        waiting.wait()
    placed = [{s["order"]["id"]: s["order"]["sku"] for s in seen} for seen in runs]
    assert placed[0] and placed[0] == placed[1], placed  # the same plan, replayed

    def skus(plan: Plan) -> dict[str, str]:
        return {order.id: order.sku for order in plan.orders if order.id in placed[0]}

    assert placed[0] == skus(Plan.draw(nemesis.plan_seed(seed, nemesis.key_from_text(text))))
    assert placed[0] != skus(Plan.draw(seed)), "the seed alone predicted the plan"
    assert placed[0] != skus(Plan.draw(nemesis.plan_seed(seed, nemesis.key_from_text("another installation"))))
    for seen in (s for run in runs for s in run):
        assert seen["decoy"] and seen["grader"] and seen["environs"], seen  # the controls: it reads argv and environs
        assert seen["seed"] == [] and seen["env"] == [], seen  # no command line carries the seed
        if OWN_USER:  # as the grader's own user it reads the grader's environment too (self-study)
            assert seen["secret"] == [], seen
