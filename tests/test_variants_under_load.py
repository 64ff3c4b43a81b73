"""Load does not change a verdict (rule 8 of msglab.grading): with every core kept busy by
spinning processes, every known file of every lab still gets its expected verdict (in a deep run;
a quick one grades each lab's solution and its share of the other files this round)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from verdicts import DEPTH, LOAD_SEED, Case, all_cases, this_round

from msglab.catalog import all_labs
from msglab.grading.grade import grade
from msglab.grading.verdict import Verdict

LABS = [lab.number for lab in all_labs()]
AT_ONCE = 4  # verdicts graded together, on top of the spinners
QUICK_SHARE = 24  # a quick run grades one in this many of a lab's other files (one or two) beside its solution
# Wrong files whose failure a starved machine can hide, each with why, until their grader forces the race: their
# verdict is still judged, but passing here is not counted against them (issue 17 item 4, test_reproducible).
KNOWN_RACES: dict[str, str] = {}


@pytest.fixture(scope="module")
def busy_cpus() -> Iterator[int]:
    """Processes spinning at 100 % for as long as this module runs: one per core but one, since the
    suite's other workers keep the last core busy too (all of them would double the suite's time)."""
    count = max(1, (os.cpu_count() or 2) - 1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield len(spinners)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def graded_under_load(request: pytest.FixtureRequest, busy_cpus: int) -> dict[str, list[tuple[Case, Verdict]]]:
    """The files of every lab this session tests here, graded AT_ONCE at a time while the spinners run: the
    spinners then live as long as the files take together, not as long as each lab in turn."""
    labs = [item.callspec.params["lab"] for item in request.session.items
            if getattr(item, "module", None) is request.module and hasattr(item, "callspec")]  # fmt: skip
    cases = [case for lab in labs for case in cases_of(lab)]
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        verdicts = list(pool.map(lambda case: grade(case.lab, source=case.path, seed=LOAD_SEED), cases))
    graded: dict[str, list[tuple[Case, Verdict]]] = {lab: [] for lab in labs}
    for case, verdict in zip(cases, verdicts, strict=True):
        graded[case.lab].append((case, verdict))
    return graded


def cases_of(lab: str) -> list[Case]:
    cases = [c for c in all_cases() if c.lab == lab]
    if DEPTH == "quick":
        others = [c for c in cases if c.name != "solution"]
        cases = [c for c in cases if c.name == "solution"] + this_round(others, QUICK_SHARE, lambda c: c.id)
    return cases


@pytest.mark.parametrize("lab", LABS)
def test_every_known_file_keeps_its_verdict_with_every_core_busy(
    no_nats_url: None, busy_cpus: int, graded_under_load: dict[str, list[tuple[Case, Verdict]]], lab: str
) -> None:
    assert busy_cpus >= 1
    graded = graded_under_load[lab]
    assert graded and any(case.name == "solution" for case, _ in graded)
    raced = [case for case, verdict in graded if case.id in KNOWN_RACES and verdict.passed]
    problems = [p for case, verdict in graded if case not in raced and (p := case.judge(verdict))]
    assert not problems, "\n\n".join(problems)
