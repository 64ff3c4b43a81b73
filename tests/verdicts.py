"""The known files of every lab and the verdict each must get: starter, solution, and variants.

A variant's docstring says what it expects, on a line of its own:
    Expect: fail no_lost_emails, all_acked     (these checks must be among the failures)
    Expect: fail a|b                           (at least one of them: the same mistake shows as
                                                either, depending on the run's timing)
    Expect: pass                               (under also_right/: a correct file written differently)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from msglab.catalog import all_labs
from msglab.grading.verdict import Verdict

VARIANTS = Path(__file__).resolve().parent / "variants"
EXPECT = re.compile(r"^[ \t]*Expect:[ \t]*(pass|fail)\b[ \t]*(.*)$", re.M)


@dataclass(frozen=True)
class Case:
    """One file of one lab and the verdict it must get."""

    lab: str  # the lab number
    name: str  # starter, solution, or the variant's path under its lab folder
    path: Path
    passes: bool
    checks: frozenset[str] = frozenset()  # for a failing file: checks that must be among the failures

    @property
    def id(self) -> str:
        return f"{self.lab}-{self.name}"

    def judge(self, verdict: Verdict) -> str:
        """An empty string when the verdict is the expected one, else what is wrong with it."""
        failed = {check.name for check in verdict.failures}
        if self.passes and not verdict.passed:
            return f"{self.id} must pass, failed {sorted(failed)}:\n{verdict.to_text()}"
        if not self.passes and verdict.passed:
            return f"{self.id} must fail, but passed:\n{verdict.to_text()}"
        if not all(failed & set(group.split("|")) for group in self.checks):
            return f"{self.id} must fail {sorted(self.checks)}; failed {sorted(failed)}:\n{verdict.to_text()}"
        return ""


def expectation(path: Path) -> tuple[bool, frozenset[str]]:
    """Read a variant's Expect line; a file without one is a test-suite error."""
    match = EXPECT.search(path.read_text())
    if not match:
        raise ValueError(f"{path} has no 'Expect: pass' or 'Expect: fail <check>' line in its docstring")
    checks = frozenset(c.strip() for c in match.group(2).split(",") if c.strip())
    return match.group(1) == "pass", checks


def all_cases() -> list[Case]:
    """Starter (fails), solution (passes) and every variant, for every lab."""
    cases = []
    for lab in all_labs():
        cases.append(Case(lab.number, "starter", lab.source(solution=False), passes=False))
        cases.append(Case(lab.number, "solution", lab.source(solution=True), passes=True))
        folder = VARIANTS / lab.name
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            passes, checks = expectation(path)
            cases.append(Case(lab.number, str(path.relative_to(folder).with_suffix("")), path, passes, checks))
    return cases
