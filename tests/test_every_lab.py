"""What every lab of the catalogue must do, written once: a file that does not import fails with its
line, never a traceback, and a failing run replays from the seed its verdict prints.

That every starter fails and teaches, every solution passes with hints for each of its checks, and
every variant gets its verdict and says its words is tests/test_variants.py (via tests/verdicts.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from verdicts import all_cases, this_round

from msglab.catalog import Lab, all_labs
from msglab.grading.grade import grade

LABS = all_labs()


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_a_file_that_does_not_import_fails_with_its_line_not_a_traceback(
    no_nats_url: None, tmp_path: Path, lab: Lab
) -> None:
    broken = tmp_path / lab.file
    broken.write_text("async def worker(env)\n    pass\n")
    verdict = grade(lab.number, source=broken, seed=1)
    assert [c.name for c in verdict.checks] == ["file_imports"], verdict.to_text()
    message = verdict.checks[0].message
    assert f"{lab.file}:1" in message and "SyntaxError" in message, message
    assert "Traceback" not in verdict.to_text()


REPLAYED = this_round(LABS, 2, lambda lab: f"replay-{lab.number}")  # half the labs a quick run, every lab a deep one


@pytest.mark.parametrize("lab", REPLAYED, ids=[lab.number for lab in REPLAYED])
def test_a_failing_run_replays_from_the_seed_its_verdict_prints(no_nats_url: None, lab: Lab) -> None:
    (starter,) = [c for c in all_cases() if c.lab == lab.number and c.name == "starter"]
    seed = max(starter.seeds) + 1  # a seed the starter meets nowhere else in the run
    with ThreadPoolExecutor(max_workers=2) as pool:
        first, again = pool.map(lambda _: grade(lab.number, seed=seed), range(2))
    assert first.replay_command() == again.replay_command() == f"msglab check {lab.number} --seed {seed}"
    for verdict in (first, again):
        assert not (problem := starter.judge(verdict)), problem
    # The seed fixes the plan (which calls crash, which requests the stream refuses): the replay shows
    # the same mistake first. Which further checks a crash also breaks can follow the machine's timing.
    assert first.failures[0].name == again.failures[0].name, (first.to_text(), again.to_text())
