"""Lab 01's grader judged on real runs: the solution passes, the starter and each wrong variant
fail for their own reason, and a failing run replays from its seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from msglab.grading.grade import grade

VARIANTS = Path(__file__).parent / "variants" / "01_request_reply_vs_events"


@pytest.mark.parametrize("seed", [1, 2])
def test_solution_passes_every_check(no_nats_url: None, seed: int) -> None:
    verdict = grade("01", solution=True, seed=seed)
    assert verdict.passed, verdict.to_text()
    assert len(verdict.checks) == 8


def test_starter_fails_and_names_temporal_coupling(no_nats_url: None) -> None:
    verdict = grade("01", seed=3)
    failed = {c.name for c in verdict.failures}
    assert {"accepts_with_email_down", "request_reply_answers"} <= failed, verdict.to_text()
    down = next(c for c in verdict.failures if c.name == "accepts_with_email_down")
    assert "temporal coupling" in down.message
    assert "NoRespondersError" in down.message  # the evidence: what place_order raised
    assert down.hint and down.trace


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("ack_before_work", "no_lost_emails"),
        ("sync_call_disguised_as_event", "accepts_with_email_down"),
        ("never_acks", "no_duplicate_emails"),
        ("ephemeral_consumer", "no_duplicate_emails"),
        ("request_without_timeout", "request_reply_timeout"),
        ("swallows_no_responders", "request_reply_no_responders"),
    ],
)
def test_wrong_variant_fails_for_its_reason(no_nats_url: None, variant: str, reason: str) -> None:
    verdict = grade("01", source=VARIANTS / f"{variant}.py", seed=4)
    failed = {c.name for c in verdict.failures}
    assert reason in failed, verdict.to_text()
    # The email path and the request-reply path are judged apart: a bug in one is not blamed on the other.
    email_side = {
        "accepts_with_email_up",
        "accepts_with_email_down",
        "no_lost_emails",
        "no_duplicate_emails",
        "all_acked",
    }
    assert failed <= email_side if reason in email_side else failed.isdisjoint(email_side), verdict.to_text()


def test_ack_before_work_loses_the_order_whose_email_crashed(no_nats_url: None) -> None:
    verdict = grade("01", source=VARIANTS / "ack_before_work.py", seed=5)
    lost = next(c for c in verdict.failures if c.name == "no_lost_emails")
    assert any("crashed while sending its email" in step for step in lost.trace)
    assert lost.trace[-1] == "never emailed"


def test_failing_run_replays_from_its_seed(no_nats_url: None) -> None:
    first = grade("01", source=VARIANTS / "ack_before_work.py", seed=11)
    again = grade("01", source=VARIANTS / "ack_before_work.py", seed=11)
    lost_first = next(c for c in first.failures if c.name == "no_lost_emails").message
    lost_again = next(c for c in again.failures if c.name == "no_lost_emails").message
    assert lost_first == lost_again  # same seed, same crash point, same lost order


def test_hanging_learner_call_is_stopped_not_waited_for(no_nats_url: None) -> None:
    verdict = grade("01", source=VARIANTS / "request_without_timeout.py", seed=6)
    timeout = next(c for c in verdict.failures if c.name == "request_reply_timeout")
    assert "the grader stopped it" in timeout.message


def test_broken_file_fails_with_its_line_not_a_traceback(no_nats_url: None, tmp_path: Path) -> None:
    broken = tmp_path / "orders.py"
    broken.write_text("async def place_order(env, order)\n    pass\n")
    verdict = grade("01", source=broken, seed=1)
    assert [c.name for c in verdict.checks] == ["file_imports"]
    assert "orders.py:1" in verdict.checks[0].message
    assert "SyntaxError" in verdict.checks[0].message
