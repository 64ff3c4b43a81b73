"""Lab 02's grader judged on real runs: the solution passes, the starter and each wrong variant
fail for their own reason, and a failing run replays from its seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from msglab.grading.grade import grade

VARIANTS = Path(__file__).parent / "variants" / "02_delivery_guarantees"
WORKER_CHECKS = {"no_lost_invoices", "duplicates_only_after_work_crash", "all_acked", "settled_reported"}


@pytest.mark.parametrize("seed", [1, 2])
def test_solution_passes_every_check(no_nats_url: None, seed: int) -> None:
    verdict = grade("02", solution=True, seed=seed)
    assert verdict.passed, verdict.to_text()
    assert len(verdict.checks) == 5


def test_starter_fails_and_says_acking_first_loses_invoices(no_nats_url: None) -> None:
    verdict = grade("02", seed=3)
    failed = {c.name for c in verdict.failures}
    assert {"no_lost_invoices", "guarantees_named"} <= failed, verdict.to_text()
    lost = next(c for c in verdict.failures if c.name == "no_lost_invoices")
    assert "at-most-once" in lost.message  # the broken guarantee, named
    assert lost.hint and lost.trace[-1] == "never invoiced"
    assert any("SIGKILLed before the invoice went out" in step for step in lost.trace)


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("ack_before_work", "no_lost_invoices"),
        ("ack_without_sync", "duplicates_only_after_work_crash"),
        ("never_acks", "all_acked"),
        ("ack_in_finally", "no_lost_invoices"),
        ("settled_before_ack", "duplicates_only_after_work_crash"),
        ("wrong_guarantees", "guarantees_named"),
    ],
)
def test_wrong_variant_fails_for_its_reason(no_nats_url: None, variant: str, reason: str) -> None:
    verdict = grade("02", source=VARIANTS / f"{variant}.py", seed=4)
    failed = {c.name for c in verdict.failures}
    assert reason in failed, verdict.to_text()
    # The worker and the classification are judged apart: a bug in one is not blamed on the other.
    assert failed <= WORKER_CHECKS if reason in WORKER_CHECKS else failed == {reason}, verdict.to_text()


def test_bare_ack_is_caught_by_the_crash_right_after_it(no_nats_url: None) -> None:
    verdict = grade("02", source=VARIANTS / "ack_without_sync.py", seed=5)
    assert {c.name for c in verdict.failures} == {"duplicates_only_after_work_crash"}, verdict.to_text()
    twice = verdict.failures[0]
    assert "ack_sync" in twice.hint
    assert any("SIGKILLed in env.settled" in step for step in twice.trace)
    assert sum("invoice sent" in step for step in twice.trace) == 2  # the evidence: two invoices, one order


def test_finally_ack_loses_the_request_whose_call_failed(no_nats_url: None) -> None:
    verdict = grade("02", source=VARIANTS / "ack_in_finally.py", seed=6)
    lost = next(c for c in verdict.failures if c.name == "no_lost_invoices")
    assert "TransientError" in lost.message and "nak" in lost.hint
    assert any("raised TransientError" in step for step in lost.trace)


def test_failing_run_replays_from_its_seed(no_nats_url: None) -> None:
    first = grade("02", source=VARIANTS / "ack_before_work.py", seed=11)
    again = grade("02", source=VARIANTS / "ack_before_work.py", seed=11)
    lost_first = next(c for c in first.failures if c.name == "no_lost_invoices").message
    lost_again = next(c for c in again.failures if c.name == "no_lost_invoices").message
    assert lost_first == lost_again  # same seed, same crash points, same lost invoices


def test_broken_file_fails_with_its_line_not_a_traceback(no_nats_url: None, tmp_path: Path) -> None:
    broken = tmp_path / "invoices.py"
    broken.write_text("async def invoice_worker(env)\n    pass\n")
    verdict = grade("02", source=broken, seed=1)
    assert [c.name for c in verdict.checks] == ["file_imports"]
    assert "invoices.py:1" in verdict.checks[0].message


@pytest.mark.parametrize("variant", ["flush_after_ack", "batch_without_nak"])
def test_other_right_workers_pass_too(no_nats_url: None, variant: str) -> None:
    # The grader judges behaviour, not the solution's shape: a flushed ack or a bigger batch is fine.
    verdict = grade("02", source=VARIANTS / "also_right" / f"{variant}.py", seed=7)
    assert verdict.passed, verdict.to_text()
