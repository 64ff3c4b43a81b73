"""Load does not change a verdict (rule 8 of msglab.grading): with every core kept busy by
spinning processes, every known file of every lab still gets its expected verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from verdicts import Case, all_cases

from msglab.grading.grade import grade

CASES = all_cases()
SEED = 11  # not one of test_variants' seeds: one more seed, under load


@pytest.fixture(scope="module")
def busy_cpus() -> Iterator[int]:
    """One process spinning at 100 % per core, for as long as this module runs."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield len(spinners)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verdict_holds_with_every_core_busy(no_nats_url: None, busy_cpus: int, case: Case) -> None:
    assert busy_cpus >= 1
    verdict = grade(case.lab, source=case.path, seed=SEED)
    problem = case.judge(verdict)
    assert not problem, problem
