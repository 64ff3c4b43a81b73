"""A grader that untrusted code cannot fool, hang or harm: every attacking or careless
submission in tests/hostile/ fails (never passes), within the run's budget, leaves no process,
no folder and no mount behind, and the next verdict is unaffected. A deep run sends every attack
at every lab; a quick one about half the attacks, each at one lab (another share each commit)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import ATTACKS, PRELUDE, Attack, mark_folder
from verdicts import this_round

from msglab.catalog import Lab, all_labs
from msglab.grading.grade import CLEANUP_TIMEOUT, GRADE_TIMEOUT, grade
from msglab.grading.harness import RUN_PREFIX, runs_folder
from msglab.grading.sandbox import Sandbox

OWN_USER = Sandbox.for_this_machine().uid is not None
LABS = all_labs()
# Most attacks hit every lab (in a deep run; a quick one, its share of them this round: verdicts.DEPTH);
# the others (see Attack.every_lab) hit one, the labs taking turns.
ONE_LAB = [attack for attack in ATTACKS if not attack.every_lab]
QUICK_SHARE = 8  # a quick run sends an every-lab attack at about one lab in eight


def _targets(attack: Attack) -> list[Lab]:
    if not attack.every_lab:
        return [LABS[ONE_LAB.index(attack) % len(LABS)]]
    return this_round(LABS, QUICK_SHARE, lambda lab: f"{attack.name}-{lab.number}")


# A quick run sends a third of the attacks (another third each commit, each at its lab); a deep run, all.
QUICK_ATTACKS = 3
CASES = this_round(
    [(lab, attack) for attack in ATTACKS for lab in _targets(attack)], QUICK_ATTACKS, lambda c: c[1].name
)


@pytest.fixture
def mark() -> Iterator[Path]:
    """A folder outside the run where the hostile code leaves pids and outcomes."""
    folder = mark_folder("msglab-hostile-")
    yield folder
    for name in os.listdir(folder):
        os.unlink(folder / name)
    folder.rmdir()


def submission(lab: Lab, attack: Attack, mark: Path) -> Path:
    """The lab's starter with the attack appended, in a folder of its own."""
    folder = mark.parent / f"{mark.name}-src"
    folder.mkdir(exist_ok=True)
    path = folder / lab.file
    starter = lab.source(solution=False).read_text()
    path.write_text(starter + PRELUDE.format(mark=str(mark)) + attack.code.replace("{lab!r}", repr(lab.number)))
    return path


def reports(mark: Path) -> list[str]:
    return [(mark / name).read_text() for name in sorted(os.listdir(mark)) if not name.endswith(".part")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead; only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize(("lab", "attack"), CASES, ids=[f"{lab.number}-{attack.name}" for lab, attack in CASES])
def test_hostile_submission_fails_in_time_and_leaves_nothing(
    no_nats_url: None, mark: Path, lab: Lab, attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    if attack.own_user and not OWN_USER:
        pytest.skip("needs learner code to run as a user of its own (grader as root, Python readable by others)")
    source = submission(lab, attack, mark)
    try:
        verdict = grade(lab.number, source=source, seed=1)
    finally:
        for leftover in source.parent.iterdir():
            leftover.unlink()
        source.parent.rmdir()
    text = verdict.to_text() + verdict.to_json()
    assert not verdict.passed, text
    assert verdict.seconds < GRADE_TIMEOUT + CLEANUP_TIMEOUT, text
    assert "\x1b" not in text and "\x07" not in text
    if attack.name == "blocking_sleep_at_import":  # the grader stopped it at its ready deadline, and says so
        assert "(the grader stopped it)" in text and "not by the grader" not in text, text
    said = reports(mark)
    survivors = [int(w.split()[1]) for w in said if w.startswith("pid ") and alive(int(w.split()[1]))]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the verdict: {survivors}"
    outcomes = [w for w in said if w.startswith("outcome ")]
    if attack.name == "malformed_pull_requests":
        assert outcomes, "the malformed pull requests were never sent"
        # None raised inside the grader's broker watch (nats-py logs a callback's exception as an error).
        raised = [r for r in caplog.records if r.exc_info and r.name.startswith(("nats", "asyncio", "msglab"))]
        assert not raised, [r.getMessage() for r in raised]
    assert all(w.startswith("outcome refused") for w in outcomes), outcomes
    assert not list(Path(runs_folder()).glob(f"{RUN_PREFIX}{os.getpid()}-*")), "the run left its folder"
    mounts = Path("/proc/self/mountinfo").read_text() if Path("/proc/self/mountinfo").exists() else ""
    assert f"{RUN_PREFIX}{os.getpid()}-" not in mounts, "the run left its bounded home mounted"


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_next_verdict_after_the_corpus_is_unaffected(no_nats_url: None, lab: Lab) -> None:
    verdict = grade(lab.number, solution=True, seed=2)
    assert verdict.passed, verdict.to_text()
