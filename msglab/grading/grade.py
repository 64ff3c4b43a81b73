"""Grade one lab: pick the file, draw or take the seed, run its grader, return a Verdict.

Each grader module (`msglab.graders.<topic>`) defines `async def grade(run) -> list[Check]`
plus the roles its child processes play; workload and checker live together in that one file.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import time
from pathlib import Path

from msglab.catalog import find_lab
from msglab.errors import GraderError, LabError, MsglabError
from msglab.grading.harness import BrokenLearnerFile, Run
from msglab.grading.verdict import Check, Verdict

GRADE_TIMEOUT = 60.0  # no grading run may take longer, whatever the learner's code does


def new_seed() -> int:
    """A fresh seed; printed with every verdict so the run can be replayed."""
    return random.SystemRandom().randrange(1, 1_000_000)


def grade(key: str, *, solution: bool = False, seed: int | None = None, source: str | Path | None = None) -> Verdict:
    """Grade lab `key` (the learner's file, the solution, or any `source` file) and return the verdict."""
    lab = find_lab(key)
    path = Path(source) if source else lab.source(solution)
    if not path.is_file():
        raise LabError(f"{path} does not exist", hint=f"the lab's file is {lab.folder / lab.file}")
    seed = new_seed() if seed is None else seed
    started = time.perf_counter()
    try:
        verdict = asyncio.run(_grade(lab.grader_module, str(path.resolve()), seed))
    except MsglabError:
        raise
    except Exception as exc:  # the grader's own failure is never the learner's FAIL
        raise GraderError(f"grading lab {lab.number} with seed {seed} failed inside the grader: {exc!r}") from exc
    verdict.lab = lab.name
    verdict.solution = solution and source is None
    verdict.seconds = time.perf_counter() - started
    return verdict


async def _grade(grader_name: str, path: str, seed: int) -> Verdict:
    grader = importlib.import_module(grader_name)
    verdict = Verdict(lab="", graded=_short(path), seed=seed)
    async with Run(grader_name, path, seed) as run:
        verdict.server = run.server_description
        try:
            checks = await asyncio.wait_for(grader.grade(run), GRADE_TIMEOUT)
            # Rules 1 and 3 hold for every lab: planned faults fired, no process died on its own.
            named = {check.name for check in checks}
            checks += [c for c in (run.faults_check(), run.deaths_check()) if c.name not in named]
            verdict.checks = checks
        except BrokenLearnerFile as broken:
            info = broken.info
            where = f" at {info['where']}" if info.get("where") else ""
            verdict.checks = [
                Check(
                    "file_imports",
                    "your lab file imports",
                    False,
                    f"{_short(path)} did not import{where}: {info['error']}: {info['message']}",
                    hint="fix that line first; the grader cannot run code that does not import",
                )
            ]
        except TimeoutError:
            verdict.checks = [
                Check("finishes", "grading finishes", False, f"grading did not finish within {GRADE_TIMEOUT:.0f} s",
                      hint="look for a loop in your code that never awaits anything")
            ]  # fmt: skip
        verdict.output = run.output_tail()
    return verdict


def _short(path: str) -> str:
    from msglab.catalog import course_root

    try:
        return str(Path(path).relative_to(course_root()))
    except ValueError:
        return path
