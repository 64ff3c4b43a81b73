"""Every lab's starter fails, its solution passes, and every known variant, wrong or written
differently, gets its expected verdict, on five seeds (rule 9 of msglab.grading)."""

from __future__ import annotations

import pytest
from verdicts import Case, all_cases

from msglab.grading.grade import grade

SEEDS = (1, 2, 3, 4, 5)
CASES = all_cases()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_known_file_gets_its_expected_verdict(no_nats_url: None, case: Case, seed: int) -> None:
    verdict = grade(case.lab, source=case.path, seed=seed)
    problem = case.judge(verdict)
    assert not problem, problem


def test_every_variant_declares_what_it_expects() -> None:
    wrong = [c for c in CASES if c.name not in ("starter", "solution") and not c.passes]
    assert wrong, "no wrong variants found"
    assert all(c.checks for c in wrong), [c.id for c in wrong if not c.checks]
