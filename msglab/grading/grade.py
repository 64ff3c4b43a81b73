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
from typing import Any

from msglab.catalog import Lab, find_lab
from msglab.errors import GraderError, LabError, MsglabError
from msglab.grading.harness import BrokenLearnerFile, Run
from msglab.grading.verdict import Check, Verdict

GRADE_TIMEOUT = 45.0  # the grader's workload and checks, whatever the learner's code does
CLEANUP_TIMEOUT = 15.0  # set-up and clean-up on top: the whole run never takes longer than the sum
MESSAGE_CHARS, TRACE_LINES, LINE_CHARS = 1500, 20, 300  # a verdict's size is bounded


def new_seed() -> int:
    """A fresh seed; printed with every verdict so the run can be replayed."""
    return random.SystemRandom().randrange(1, 1_000_000)


def grade(
    key: str | Lab, *, solution: bool = False, seed: int | None = None, source: str | Path | None = None
) -> Verdict:
    """Grade lab `key` (the learner's file, the solution, or any `source` file) and return the verdict.

    `key` is a lab's number or name, or a Lab (catalog.load_lab: the example lab, outside the course).
    """
    lab = key if isinstance(key, Lab) else find_lab(key)
    if solution and source is None:
        from msglab.classroom.edition import require_solution

        require_solution(lab)  # the learner edition says plainly that it has none
    path = Path(source) if source else lab.source(solution)
    if not path.is_file():
        raise LabError(f"{path} does not exist", hint=f"the lab's file is {lab.folder / lab.file}")
    seed = new_seed() if seed is None else seed
    started = time.perf_counter()
    unreadable = _unreadable(path)
    try:
        if unreadable:
            verdict = Verdict(lab="", graded=_short(str(path)), seed=seed, checks=[unreadable])
        else:
            verdict = asyncio.run(_grade(lab.grader_module, str(path.resolve()), seed))
    except MsglabError:
        raise
    except Exception as exc:  # the grader's own failure is never the learner's FAIL
        raise GraderError(f"grading lab {lab.number} with seed {seed} failed inside the grader: {exc!r}") from exc
    verdict.lab = lab.name
    verdict.solution = solution and source is None
    verdict.seconds = time.perf_counter() - started
    for check in verdict.checks:
        _bound(check)
    return verdict


def _unreadable(path: Path) -> Check | None:
    """A failing check for a file the grader cannot even start: unreadable, not text, or empty."""
    title = "your lab file imports"
    try:
        text = path.read_text(encoding="utf-8")
    except PermissionError:
        return Check("file_imports", title, False, f"{_short(str(path))} cannot be read (permission denied)",
                     hint=f"give yourself read access again: chmod u+r {path.name}")  # fmt: skip
    except UnicodeDecodeError as exc:
        return Check("file_imports", title, False, f"{_short(str(path))} is not UTF-8 text ({exc.reason})",
                     hint="save the file as UTF-8 text from your editor")  # fmt: skip
    code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not code:
        return Check("file_imports", title, False, f"{_short(str(path))} is empty: there is no code to run",
                     hint="restore the starter with `msglab reset NN` (it keeps a backup) and start over")  # fmt: skip
    return None


def _bound(check: Check) -> None:
    """Cap what a check quotes: learner output and errors can be arbitrarily long."""
    if len(check.message) > MESSAGE_CHARS:
        check.message = check.message[:MESSAGE_CHARS] + " …"
    check.hint = check.hint[:MESSAGE_CHARS]
    check.trace = [line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " …" for line in check.trace]
    if len(check.trace) > TRACE_LINES:
        check.trace = [*check.trace[: TRACE_LINES // 2], "…", *check.trace[-TRACE_LINES // 2 :]]


async def _grade(grader_name: str, path: str, seed: int) -> Verdict:
    grader = importlib.import_module(grader_name)
    verdict = Verdict(lab="", graded=_short(path), seed=seed)
    try:
        async with asyncio.timeout(GRADE_TIMEOUT + CLEANUP_TIMEOUT):
            await _run(grader, grader_name, path, seed, verdict)
    except TimeoutError:
        verdict.checks = [
            Check("finishes", "grading finishes", False,
                  f"the run did not finish within {GRADE_TIMEOUT + CLEANUP_TIMEOUT:.0f} s; the grader stopped it",
                  hint="look for a loop in your code that never awaits anything, or a call that blocks")
        ]  # fmt: skip
    return verdict


async def _run(grader: Any, grader_name: str, path: str, seed: int, verdict: Verdict) -> None:
    async with Run(grader_name, path, seed) as run:
        verdict.server = run.server_description
        try:
            checks = await _within(grader.grade(run), GRADE_TIMEOUT)
            # Rules 1 and 3 hold for every lab (msglab.grading.rules): planned faults fired, no process
            # died on its own. A grader never returns these checks itself (phase 1 leaves old ones be).
            named = {check.name for check in checks}
            checks += [c for c in (run.faults_check(), run.deaths_check()) if c.name not in named]
            verdict.checks = checks
        except BrokenLearnerFile as broken:
            info = broken.info
            where = f" at {info['where']}" if info.get("where") else ""
            started = info.get("error") == "DidNotStart"
            verdict.checks = [
                Check(
                    "file_imports",
                    "your lab file imports",
                    False,
                    f"{_short(path)} did not import{where}: {info['error']}: {info['message']}",
                    hint="code at the top level of your file runs when it is imported: a loop or a blocking call "
                    "there keeps the process from starting; move it into a function"
                    if started
                    else "fix that line first; the grader cannot run code that does not import",
                )
            ]
        except TimeoutError:
            verdict.checks = [
                Check("finishes", "grading finishes", False, f"grading did not finish within {GRADE_TIMEOUT:.0f} s",
                      hint="look for a loop in your code that never awaits anything, or a call that blocks")
            ]  # fmt: skip
        verdict.output = run.output_tail()


async def _within(work: Any, timeout: float) -> Any:
    """Await work with a deadline; on a timeout, say where the grader was waiting (on stderr), then raise."""
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if task in done:
        return task.result()
    import io
    import sys

    where = io.StringIO()
    task.print_stack(file=where)
    print(f"msglab: the grader was still waiting after {timeout:.0f} s:\n{where.getvalue()}", file=sys.stderr)
    task.cancel()
    raise TimeoutError


def _short(path: str) -> str:
    from msglab.catalog import course_root

    try:
        return str(Path(path).relative_to(course_root()))
    except ValueError:
        return path
