"""Lab 02's grader judged on real runs: each test names a behaviour the grader must have.

The five-seed sweep of every variant lives in test_variants.py, and the words each variant's verdict
must contain are its `Says:` lines; here is what no variant's verdict shows: the evidence quoted
checked against what the run recorded, replay, and that a mistake fails only the checks it breaks.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import msglab.graders.delivery_guarantees as grader
from msglab.catalog import find_lab
from msglab.grading.grade import grade
from msglab.grading.nemesis import plan_seed
from msglab.grading.rules import squash
from msglab.grading.verdict import Verdict

VARIANTS = Path(__file__).parent / "variants" / "02_delivery_guarantees"
LAB = find_lab("02")


def failure(verdict: Verdict, name: str) -> grader.Check:
    found = next((c for c in verdict.failures if c.name == name), None)
    assert found is not None, f"{name} did not fail:\n{verdict.to_text()}"
    return found


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[grader.Billing]]:
    """The grader's own record of each run (requests, effects, acks), to hold the verdict against."""
    seen: list[grader.Billing] = []

    class Recorded(grader.Billing):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            seen.append(self)

    monkeypatch.setattr(grader, "Billing", Recorded)
    yield seen


def test_starter_fails_and_teaches_that_acking_first_loses_invoices(no_nats_url: None) -> None:
    verdict = grade("02", seed=3)
    failed = {c.name for c in verdict.failures}
    assert {"no_lost_invoices", "guarantees_named", "refused_requests_reported"} <= failed, verdict.to_text()
    assert all(c.message and c.hint for c in verdict.failures)
    lost = failure(verdict, "no_lost_invoices")
    assert lost.trace[-1] == "never invoiced"
    # Which lost order the message explains can depend on timing: one a kill hit after its ack (the
    # broken guarantee, named), or one the service refused (what to do instead, in the hint).
    assert "at-most-once" in lost.message or "leave that request unacked" in (lost.hint or ""), lost.message
    assert any("SIGKILLed by the grader" in step or "raised" in step for step in lost.trace), lost.trace


def test_batch_worker_is_allowed_exactly_the_duplicates_its_crash_explains(
    no_nats_url: None, runs: list[grader.Billing]
) -> None:
    # Rule 6: fetch ten, send ten invoices, then ack ten. A kill after the 2nd invoice of a batch
    # leaves every invoice sent so far unacked: all of them come back and go out again, and all
    # are explained by that one crash.
    seed = next(s for s in range(1, 50) if ("after_work", 2) in grader.Plan.draw(plan_seed(s)).crashes)
    verdict = grade("02", source=VARIANTS / "also_right" / "batch_acks_after_batch.py", seed=seed)
    assert verdict.passed, verdict.to_text()
    [lab] = runs
    twice = {key for key, n in lab.counts().items() if n == 2}
    assert len(twice) >= 2, lab.counts()  # more than the one request the crash fell on
    assert all(lab.allowed_invoices(key) == 2 for key in twice)


def test_bare_ack_is_caught_by_the_report_and_by_the_crash_right_after_it(
    no_nats_url: None, runs: list[grader.Billing]
) -> None:
    verdict = grade("02", source=VARIANTS / "ack_without_sync.py", seed=5)
    assert {c.name for c in verdict.failures} == {"settled_after_ack"}, verdict.to_text()
    check = failure(verdict, "settled_after_ack")
    assert "queued the ack" in check.hint
    # The evidence quoted is the evidence recorded: a report with no ack on the broker, a kill right
    # after it, and the same request invoiced again by the next worker.
    [lab] = runs
    key = re.search(r"env\.settled\('(o-\d+)'\) arrived", check.message).group(1)  # type: ignore[union-attr]
    crash = next(c for c in lab.crashes() if c.name == "settled")
    assert crash.key == key
    assert lab.watch.settled_on_broker(lab.requests[key].seq, before=crash.ts) is None
    assert len({e.pid for e in lab.invoices(key)}) == 2
    assert sum("invoice sent" in step for step in check.trace) == 2


def test_acking_only_the_last_of_a_batch_is_an_unexplained_duplicate(no_nats_url: None) -> None:
    # The count the message quotes is the count the trace shows (the hint is the variant's Says line).
    verdict = grade("02", source=VARIANTS / "acks_last_of_batch.py", seed=1)
    check = failure(verdict, "duplicates_only_after_crash")
    times = int(re.search(r"went out (\d+) times", check.message).group(1))  # type: ignore[union-attr]
    shown = sum("invoice sent" in step for step in check.trace)
    # The grader's cut of a long trace keeps every invoice line (under load it went out 7 times, and its
    # "... more steps ..." had taken one); only a trace over the verdict's bound loses some, around a "…".
    assert shown == times or ("…" in check.trace and 0 < shown < times), check.trace


def cut(steps: list[tuple[float, str, bool]], keep: int, pinned_are: str) -> list[str]:
    """Steps (when, line, pinned) in any order, cut as the grader's Trace cuts them (rules.squash)."""
    ordered = sorted(steps, key=lambda step: step[0])
    return squash([line for _, line, _ in ordered], keep, [i for i, step in enumerate(ordered) if step[2]], pinned_are)


def test_a_cut_trace_keeps_every_pinned_line() -> None:
    # 7 invoices, each followed by its report, then the ack: over the 14 lines a trace keeps, the cut
    # takes reports only, and one line says so.
    steps = [(0.0, "published", False)]
    for i in range(1, 8):
        steps += [(i + 0.1, f"invoice {i}", True), (i + 0.2, f"report {i}", False)]
    steps += [(8.0, "ack", False)]
    lines = cut(list(reversed(steps)), grader.TRACE_LINES, "the invoices")
    assert [line for line in lines if line.startswith("invoice")] == [f"invoice {i}" for i in range(1, 8)]
    assert lines[:2] == ["published", "invoice 1"] and lines[-3:] == ["invoice 7", "report 7", "ack"]
    assert len(lines) == grader.TRACE_LINES
    assert [line for line in lines if line.startswith("...")] == [
        "... 3 more steps from here on, not shown (the invoices all are) ..."
    ]
    # A short trace is shown whole, and one with nothing pinned is cut as rules.squash cuts it.
    assert cut(steps[:5], grader.TRACE_LINES, "") == [line for _, line, _ in steps[:5]]
    plain = [(ts, line, False) for ts, line, _ in steps]
    assert cut(plain, grader.TRACE_LINES, "") == squash([line for _, line, _ in plain], grader.TRACE_LINES)


ONLY = [  # (variant, seed, the checks it fails): what each variant says lives in its Says lines
    ("drops_unavailable", 4, {"no_lost_invoices"}),
    # Never reporting, it also never meets the kill planned right before the first env.reject (rule 1).
    ("retries_refused_forever", 4, {"refused_requests_reported", "all_acked", "faults_fired"}),
    # rule 5: a budget fails both (and, never reporting, it meets no kill before env.reject)
    ("gives_up_after_three", 6, {"no_lost_invoices", "refused_requests_reported", "faults_fired"}),
    ("returns_when_idle", 3, {"survives_idle", "no_unplanned_deaths"}),
    ("let_it_crash", 2, {"no_unplanned_deaths"}),  # restarted, so the other checks judge the rest (rule 7)
]


@pytest.mark.parametrize(("variant", "seed", "failed"), ONLY, ids=[v for v, _, _ in ONLY])
def test_a_mistake_fails_only_the_checks_it_breaks(
    no_nats_url: None, variant: str, seed: int, failed: set[str]
) -> None:
    # Rule 7: an `Expect:` line says which checks must fail; here, that no other check does.
    verdict = grade("02", source=VARIANTS / f"{variant}.py", seed=seed)
    assert {c.name for c in verdict.failures} == failed, verdict.to_text()


def test_kill_before_the_report_brings_a_report_first_request_back(
    no_nats_url: None, runs: list[grader.Billing]
) -> None:
    # The solution reports, then settles: killed right before env.reject, it had settled nothing, so the
    # broker delivers the closed account again and the next worker reports it, once, then settles it.
    verdict = grade("02", solution=True, seed=2)
    assert verdict.passed, verdict.to_text()
    [lab] = runs
    [kill] = [c for c in lab.crashes() if c.name == "reject"]
    key = kill.key or ""
    [report] = lab.calls("reject", key)
    assert report.pid != kill.pid and report.ts > kill.ts
    settled = lab.watch.settled_on_broker(lab.requests[key].seq)
    assert settled is not None and settled.ts > report.ts
    assert {e.pid for e in lab.calls("send_invoice", key)} == {kill.pid, report.pid}


def test_failing_run_replays_from_its_seed(no_nats_url: None) -> None:
    # The seed fixes the plan (which calls crash, which requests refuse); which order a crash happens
    # to hit, and so which further checks a crash also breaks, can depend on the machine's timing: the
    # replay is judged by the plan and by the mistake it shows.
    first = grade("02", source=VARIANTS / "ack_before_work.py", seed=11)
    again = grade("02", source=VARIANTS / "ack_before_work.py", seed=11)
    assert first.seed == again.seed == 11  # one plan: drawn from plan_seed(11) (tests/test_hostile_grader.py)
    for verdict in (first, again):
        assert "at-most-once" in failure(verdict, "no_lost_invoices").message, verdict.to_text()


def test_broken_file_fails_with_its_line_not_a_traceback(no_nats_url: None, tmp_path: Path) -> None:
    broken = tmp_path / "invoices.py"
    broken.write_text("async def invoice_worker(env)\n    pass\n")
    verdict = grade("02", source=broken, seed=1)
    assert [c.name for c in verdict.checks] == ["file_imports"]
    assert "invoices.py:1" in verdict.checks[0].message


def test_every_check_has_hints_in_lab_toml(no_nats_url: None) -> None:
    verdict = grade("02", solution=True, seed=1)
    assert verdict.passed, verdict.to_text()
    names = {c.name for c in verdict.checks}
    assert len(names) == 12
    missing = names - set(LAB.hints)
    assert not missing, f"lab.toml has no [hints.<id>] for {sorted(missing)}"
    assert all(LAB.hints[n].concept and LAB.hints[n].lesson and LAB.hints[n].code for n in names)


def test_readme_counts_are_the_graders() -> None:
    readme = (LAB.folder / "README.md").read_text()
    finals = grader.FINAL_NORMAL + grader.TRANSIENT + grader.REFUSED
    total = len(grader.KINDS) * grader.FRESH + finals
    for claim in (
        f"Each of the first {len(grader.KINDS)} gets {grader.FRESH} fresh invoice",
        f"gets {finals} more requests: {grader.FINAL_NORMAL} the invoicing service takes, {grader.TRANSIENT} it",
        f"and {grader.REFUSED} it can never take",
        f"every try fails for {grader.OUTAGE[0]} to {grader.OUTAGE[1]} s",
        f"({total - grader.REFUSED} of the {total} must be invoiced",
        f"ack_wait {grader.ACK_WAIT} s",
        "then 11 checks",
        f"takes {grader.SLOW[0]} to {grader.SLOW[1]} s over its invoice",
        f"at least {grader.MIN_RETRY_GAP} s",
    ):
        assert claim in " ".join(readme.split()), claim
    assert "solutions/" not in readme  # the verdict says where the solution is, after a few tries


def test_todos_state_requirements_not_calls() -> None:
    starter = (LAB.folder / LAB.file).read_text()
    todos = re.findall(r"#\s*TODO:\s*(.+)", starter)
    assert len(todos) >= 4
    for todo in todos:
        assert not re.search(r"\bmsg\.|\benv\.|ack_sync|\bnak\b|\bterm\b|\bflush\b|in_progress|\(", todo), todo


def test_every_lesson_reference_names_a_heading_of_the_lesson() -> None:
    # Level 2 of a hint sends the learner to a place in the lesson: each 'quoted' name must be a heading there.
    meta = tomllib.loads((LAB.folder / "lab.toml").read_text())
    notebook = json.loads((LAB.folder.parent.parent / meta["lesson"]).read_text())
    headings = {
        re.sub(r"^#+\s*(\d+\.\s*)?", "", line).strip()
        for cell in notebook["cells"]
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("#")
    }
    for check, hint in meta["hints"].items():
        named = re.findall(r"'([^']+)'", hint.get("lesson", ""))
        assert hint.get("lesson") is None or named, f"{check}: {hint['lesson']!r} names no heading"
        missing = [name for name in named if name not in headings]
        assert not missing, f"{check}: no heading {missing} in {meta['lesson']}"
