"""Every lab's starter fails and teaches, its solution passes, and every known variant, wrong or
written differently, gets its expected verdict and says what its `Says:` lines say, on four seeds of
its own (rule 9 of msglab.grading; the fifth is seed 11, in tests/test_variants_under_load.py): all
four in a deep run, one a round in a quick one (verdicts.DEPTH). A quick run grades every starter,
solution and from-lesson file, and one in five of the other variants (another share each
commit); a deep run grades them all."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from verdicts import LOAD_SEED, Case, all_cases, this_round, verdict_slot

from msglab.grading.grade import grade
from msglab.grading.verdict import Verdict

CASES = all_cases()
QUICK_SHARE = 5  # a quick run grades one in five of the variants that are not always graded


def always(case: Case) -> bool:
    """The files every run grades: what a learner starts from, the reference, and the lesson pasted."""
    return case.name in ("starter", "solution") or case.name.startswith("from_lesson")


GRADED = [case for case in CASES if always(case)] + this_round(
    [case for case in CASES if not always(case)], QUICK_SHARE, lambda case: case.id
)


@pytest.mark.parametrize("case", GRADED, ids=[c.id for c in GRADED])
def test_known_file_gets_its_expected_verdict_on_its_seeds(no_nats_url: None, case: Case) -> None:
    # Its seeds at once, each holding one of the session's verdict slots (verdicts.SLOTS): a
    # verdict mostly waits on timers, and a grader must not care (rule 8), but the machine has a limit.
    def graded(seed: int) -> Verdict:
        with verdict_slot():
            return grade(case.lab, source=case.path, seed=seed)

    with ThreadPoolExecutor(max_workers=len(case.seeds)) as pool:
        verdicts = list(pool.map(graded, case.seeds))
    problems = [f"seed {v.seed}: {p}" for v in verdicts if (p := case.judge(v))]
    assert not problems, "\n\n".join(problems)


def test_every_file_meets_five_seeds() -> None:
    assert all(len({*case.own_seeds, LOAD_SEED}) == 5 for case in CASES)
    assert all(set(case.seeds) <= set(case.own_seeds) for case in CASES)


def test_every_variant_declares_what_it_expects() -> None:
    wrong = [c for c in CASES if c.name not in ("starter", "solution") and not c.passes]
    assert wrong, "no wrong variants found"
    assert all(c.checks for c in wrong), [c.id for c in wrong if not c.checks]
