"""Attempts, hint levels, progress and reset, on a small course of their own (no grading needed).

Each test builds a one-lab course in a temporary folder (MSGLAB_ROOT) with its own state folder
(MSGLAB_STATE_DIR) and feeds `msglab.attempts.record` verdicts as `msglab check` would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from msglab import attempts
from msglab.grading.verdict import Check, Verdict

HINTS = """
[hints.no_lost_invoices]
concept = "Ack only after the work is done: a crash before the ack means the broker delivers again."
lesson = "section 3, 'Kill the worker'"
code = "await msg.ack_sync()  # after write_invoice returned"
"""
STARTER = "async def worker(env):\n    # TODO: Never lose an invoice.\n    ...\n"


@pytest.fixture
def course(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A one-lab course, with lab.toml hints for the check `no_lost_invoices`."""
    return make_course(tmp_path, monkeypatch, HINTS)


def make_course(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hints: str) -> Path:
    root = tmp_path / "course"
    lab = root / "labs" / "01_demo"
    lab.mkdir(parents=True)
    (lab / "lab.toml").write_text(
        f'title = "A demo lab"\nfile = "invoices.py"\nlesson = "lessons/01_demo.ipynb"\n{hints}'
    )
    (lab / "invoices.py").write_text(STARTER)
    (root / "solutions" / "01_demo").mkdir(parents=True)
    (root / "solutions" / "01_demo" / "invoices.py").write_text("solved = True\n")
    monkeypatch.setenv("MSGLAB_ROOT", str(root))
    monkeypatch.setenv("MSGLAB_STATE_DIR", str(tmp_path / "state"))
    return root


def verdict(*failing: str, seed: int = 1) -> Verdict:
    """A verdict of lab 01_demo whose checks `failing` failed (the others passed)."""
    checks = [
        Check(name, f"the {name} invariant", name not in failing, "the evidence", hint=f"the verdict's {name} hint")
        for name in ("no_lost_invoices", "no_double_invoices")
    ]
    return Verdict(lab="01_demo", graded="labs/01_demo/invoices.py", seed=seed, checks=checks)


def opened(notes: list[str]) -> str:
    """The hint level a verdict's notes say is open ('' if none)."""
    return next((n.split("now shows ")[1][:7] for n in notes if "now shows" in n), "")


def test_hint_levels_unlock_on_repeated_failure_of_the_same_check_and_reset_when_it_passes(course: Path) -> None:
    first = attempts.record(verdict("no_lost_invoices"))
    assert opened(first) == "" and any("fail the same check again" in note for note in first)
    assert opened(attempts.record(verdict("no_lost_invoices"))) == "level 2"
    third = attempts.record(verdict("no_lost_invoices"))
    assert opened(third) == "level 3" and "the no_lost_invoices invariant" in third[0]
    attempts.record(verdict("no_double_invoices"))  # no_lost_invoices passed this time: its levels close
    assert opened(attempts.record(verdict("no_lost_invoices"))) == ""


def test_failures_of_different_checks_do_not_add_up(course: Path) -> None:
    for failing in ("no_lost_invoices", "no_double_invoices", "no_lost_invoices"):
        notes = attempts.record(verdict(failing))
    assert opened(notes) == ""


def test_hint_prints_every_unlocked_level_and_how_to_unlock_more(course: Path) -> None:
    for _ in range(2):
        attempts.record(verdict("no_lost_invoices", seed=42))
    done = run_cli("hint", "01")
    assert done.returncode == 0, done.stderr
    assert "FAIL the no_lost_invoices invariant  (failed twice in a row)" in done.stdout
    assert "the verdict's no_lost_invoices hint" in done.stdout  # level 1
    assert "Ack only after the work is done" in done.stdout  # level 2: the idea
    assert "lessons/01_demo.ipynb, section 3, 'Kill the worker'" in done.stdout  # level 2: the lesson cell
    assert "ack_sync" not in done.stdout and "level 3 opens if this check fails again" in done.stdout
    assert "msglab check 01 --seed 42" in done.stdout

    attempts.record(verdict("no_lost_invoices"))
    code = next(line for line in run_cli("hint", "01").stdout.splitlines() if "level 3, code" in line)
    assert code.endswith("await msg.ack_sync()  # after write_invoice returned")  # code is not rewrapped


def test_hint_before_any_attempt_says_none_is_recorded(course: Path) -> None:
    done = run_cli("hint", "01")
    assert done.returncode == 0 and "no attempt of lab 01 is recorded yet" in done.stdout


def test_a_failing_check_without_hints_in_lab_toml_crashes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_course(tmp_path, monkeypatch, hints="")
    for _ in range(3):
        notes = attempts.record(verdict("no_double_invoices"))
    assert opened(notes) == ""  # nothing to offer beyond the verdict
    done = run_cli("hint", "01")
    assert done.returncode == 0, done.stderr
    assert "the verdict's no_double_invoices hint" in done.stdout
    assert "(this lab has no further hints for this check)" in done.stdout


def test_a_typo_in_the_hint_table_names_the_file_and_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_course(tmp_path, monkeypatch, hints='[hints.no_lost_invoices]\nconcpet = "..."\n')
    done = run_cli("list")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "lab.toml: hints.no_lost_invoices may only hold the strings concept, lesson, code" in done.stderr


def test_three_different_mistakes_in_a_row_do_not_name_the_solution(course: Path) -> None:
    for check in ("no_lost_invoices", "no_double_invoices", "no_lost_invoices"):  # each fixed, then another
        failed = verdict(check)
        failed.notes = attempts.record(failed)
        assert "solution" not in failed.to_text() + failed._repr_html_()


def test_the_solution_is_not_mentioned_before_three_failed_attempts_of_one_check(course: Path) -> None:
    for attempt in (1, 2, 3):
        failed = verdict("no_lost_invoices")
        failed.notes = attempts.record(failed)
        shown = failed.to_text() + failed._repr_html_()
        if attempt < 3:
            assert "solution" not in shown
    assert "the reference solution is solutions/01_demo/invoices.py" in failed.to_text()
    assert "`msglab check 01 --solution`" in failed.to_text()
    assert "msglab.check(&quot;01&quot;, solution=True)" in failed._repr_html_()  # what a notebook cell calls


def test_progress_after_a_pass_shows_when_and_the_seed(course: Path) -> None:
    import msglab

    attempts.record(verdict("no_lost_invoices", seed=7))
    attempts.record(verdict(seed=4242))
    attempts.record(verdict(seed=5))  # a later pass does not move the first one
    done = run_cli("progress")
    today = datetime.now().strftime("%Y-%m-%d")
    row = next(line for line in done.stdout.splitlines() if line.startswith("01_demo"))
    assert row.split()[1:4] == ["passed", "3", today], row
    assert row.endswith(", seed 4242")
    table = msglab.progress()._repr_html_()
    assert "A demo lab" in table and "passed" in table and "seed 4242" in table and "<table>" in table


@pytest.mark.parametrize("damage", ["{half a fi", '{"labs": {"01_demo": {"attempts": "many"}}}', "[]"])
def test_a_damaged_state_file_is_moved_aside_with_a_clear_message(course: Path, tmp_path: Path, damage: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "progress.json").write_text(damage)
    done = run_cli("progress")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "your progress file" in done.stdout and "was damaged" in done.stdout
    [aside] = state.glob("progress.json.damaged-*")
    assert aside.read_text() == damage  # kept, for whoever wants to look
    assert not (state / "progress.json").exists()
    notes = attempts.record(verdict("no_lost_invoices"))
    assert not any("damaged" in note for note in notes)  # from here on, a fresh file
    assert json.loads((state / "progress.json").read_text())["labs"]["01_demo"]["attempts"] == 1


def test_two_checks_at_once_lose_no_attempt(course: Path, tmp_path: Path) -> None:
    script = (
        "from msglab import attempts\n"
        "from msglab.grading.verdict import Check, Verdict\n"
        "for _ in range(10):\n"
        "    attempts.record(Verdict('01_demo', 'x', 1, [Check('no_lost_invoices', 't', False)]))\n"
    )
    writers = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT) for _ in range(4)]
    assert [w.wait(60) for w in writers] == [0, 0, 0, 0]
    state = tmp_path / "state"
    record = json.loads((state / "progress.json").read_text())["labs"]["01_demo"]
    assert record["attempts"] == 40 and record["streaks"] == {"no_lost_invoices": 40}
    assert not list(state.glob("*.tmp")), "a temporary file was left behind"


def commit(root: Path) -> None:
    git = ["git", "-c", "user.name=msglab", "-c", "user.email=msglab@example.invalid"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "starter"]):
        subprocess.run([*git, *args], cwd=root, check=True)


def test_reset_restores_the_starter_and_keeps_a_backup(course: Path, tmp_path: Path) -> None:
    commit(course)
    lab_file = course / "labs" / "01_demo" / "invoices.py"
    lab_file.write_text("my attempt\n")
    done = run_cli("reset", "01")
    assert done.returncode == 0, done.stderr
    assert lab_file.read_text() == STARTER
    [backup] = (tmp_path / "state" / "backups" / "01_demo").iterdir()
    assert backup.read_text() == "my attempt\n" and backup.name.endswith("-invoices.py")
    assert f"is saved as {backup}" in done.stdout  # absolute: run from outside this course


def test_reset_refuses_politely_when_the_file_is_unchanged(course: Path, tmp_path: Path) -> None:
    commit(course)
    done = run_cli("reset", "01")
    assert done.returncode == 0 and "already the starter as committed: nothing to reset" in done.stdout
    assert not (tmp_path / "state" / "backups").exists()


def test_reset_outside_a_git_checkout_says_it_cannot(course: Path) -> None:
    lab_file = course / "labs" / "01_demo" / "invoices.py"
    lab_file.write_text("my attempt\n")
    done = run_cli("reset", "01")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is not a git checkout, so there is no committed starter to restore" in done.stderr
    assert lab_file.read_text() == "my attempt\n"
