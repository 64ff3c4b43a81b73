"""Grade one lab: pick the file, draw or take the seed, run its grader, return a Verdict.

Each grader module (`msglab.graders.<topic>`) defines `async def grade(run) -> list[Check]`
plus the roles its child processes play; workload and checker live together in that one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import random
import threading
import time
from pathlib import Path
from typing import Any

from msglab.catalog import Lab, find_lab
from msglab.errors import GraderError, LabError, MsglabError
from msglab.grading.harness import BrokenLearnerFile, Run
from msglab.grading.verdict import Check, Verdict

GRADE_TIMEOUT = 45.0  # the grader's workload and checks, whatever the learner's code does
CLEANUP_TIMEOUT = 15.0  # set-up and clean-up on top: the whole run never takes longer than the sum
# The watchdog (`_watched`): a run whose event loop missed its own deadline by this much is ended from
# outside (a grader blocked in a system call never gets back to its loop), and the verdict is out
# at most WATCHDOG_GRACE later, so no verdict takes longer than DEADLINE.
WATCHDOG_AFTER = GRADE_TIMEOUT + CLEANUP_TIMEOUT + 2.0
WATCHDOG_GRACE = 5.0
DEADLINE = WATCHDOG_AFTER + WATCHDOG_GRACE
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
            verdict = _watched(lab.grader_module, str(path.resolve()), seed)
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
    from msglab.grading.effects import LearnerFileError, read_learner_file
    from msglab.grading.harness import SOURCE_LIMIT

    title = "your lab file imports"
    try:
        text = read_learner_file(str(path), follow=True, limit=SOURCE_LIMIT).decode("utf-8")  # never blocks
    except LearnerFileError as exc:
        if exc.errno == errno.EACCES:
            return Check("file_imports", title, False, f"{_short(str(path))} cannot be read (permission denied)",
                         hint=f"give yourself read access again: chmod u+r {path.name}")  # fmt: skip
        return Check("file_imports", title, False, f"{_short(str(path))} cannot be graded: {exc.strerror or exc}",
                     hint="the lab's file must be a regular text file of a sensible size")  # fmt: skip
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


class _Watched:
    """What the watchdog needs of a run in progress (set from the run's own thread)."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.verdict: Verdict | None = None
        self.error: BaseException | None = None


_current = threading.local()  # the _Watched of the run this thread is grading


def _watched(grader_name: str, path: str, seed: int) -> Verdict:
    """Run `_grade` in a thread of its own and enforce the verdict's deadline from outside it.

    The run's own timeouts live in its event loop, which a grader blocked in a system call (a FIFO
    put in place of a file it opens) never returns to. Past WATCHDOG_AFTER the watchdog ends the run
    itself (`Run.abandon`: every learner process, the server, a reader blocked on a FIFO) and the
    learner's file fails `finishes`: the learner made it hang, so it is never the grader's error.
    """
    watched = _Watched()

    def work() -> None:
        _current.watched = watched
        try:
            watched.verdict = asyncio.run(_grade(grader_name, path, seed))
        except BaseException as exc:  # handed to the caller's thread
            watched.error = exc

    thread = threading.Thread(target=work, name=f"msglab-grade-{seed}", daemon=True)
    thread.start()
    try:
        thread.join(WATCHDOG_AFTER)
    except BaseException:  # Ctrl-C: the run cleans up after itself, then the interrupt goes on
        if watched.loop is not None and watched.task is not None:
            with contextlib.suppress(RuntimeError):
                watched.loop.call_soon_threadsafe(watched.task.cancel)
        thread.join(WATCHDOG_GRACE)
        raise
    if not thread.is_alive():
        if watched.error is not None:
            raise watched.error
        assert watched.verdict is not None
        return watched.verdict
    return _abandoned(watched, thread, path, seed)


def _abandoned(watched: _Watched, thread: threading.Thread, path: str, seed: int) -> Verdict:
    """The watchdog's verdict on a run stuck past its deadline; the run is ended from this thread."""
    import sys

    print(f"msglab: the run was still going {WATCHDOG_AFTER:.0f} s after it began; the watchdog ended it",
          file=sys.stderr)  # fmt: skip
    run = watched.run
    if run is not None:
        run.abandon()  # not cancelled: a grader freed from its block finishes and cleans up by itself
    thread.join(WATCHDOG_GRACE)
    if run is not None and thread.is_alive():
        run.abandon(remove=True)  # nobody is coming back for the run's folder
    verdict = Verdict(lab="", graded=_short(path), seed=seed)
    verdict.server = run.server_description if run is not None else ""
    verdict.checks = [
        Check("finishes", "grading finishes", False,
              f"the run did not finish within {GRADE_TIMEOUT + CLEANUP_TIMEOUT:.0f} s and the grader ended it "
              "from outside: it was blocked (a file of yours the grader reads that never gives data, such as "
              "a FIFO, or a call that never returns)",
              hint="leave the files the grader reads as the regular files they are, and look for a call that "
                   "blocks forever")
    ]  # fmt: skip
    verdict.output = run.output_tail() if run is not None else []
    return verdict


async def _grade(grader_name: str, path: str, seed: int) -> Verdict:
    watched = getattr(_current, "watched", None)
    if watched is not None:
        watched.loop, watched.task = asyncio.get_running_loop(), asyncio.current_task()
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
    run = Run(grader_name, path, seed)
    watched = getattr(_current, "watched", None)
    if watched is not None:
        watched.run = run
    try:
        async with run:
            verdict.server = run.server_description
            try:
                checks = await _within(grader.grade(run), GRADE_TIMEOUT)
                # Rules 1 and 3 hold for every lab (msglab.grading.rules): planned faults fired, no process
                # died on its own. A grader never returns these checks itself (phase 1 leaves old ones be).
                named = {check.name for check in checks}
                checks += [c for c in (run.faults_check(), run.deaths_check()) if c.name not in named]
                verdict.checks = checks
            except BrokenLearnerFile as broken:
                verdict.checks = [_broken(path, broken.info)]
            except TimeoutError:
                verdict.checks = [
                    Check("finishes", "grading finishes", False, f"grading did not finish within {GRADE_TIMEOUT:.0f} s",
                          hint="look for a loop in your code that never awaits anything, or a call that blocks")
                ]  # fmt: skip
            verdict.output = run.output_tail()
    except BrokenLearnerFile as broken:  # the file could not even be copied into the run (not a regular file)
        verdict.checks = [_broken(path, broken.info)]


def _broken(path: str, info: dict[str, Any]) -> Check:
    """file_imports, failed: the learner's file did not import (or its process never got ready)."""
    where = f" at {info['where']}" if info.get("where") else ""
    started = info.get("error") == "DidNotStart"
    return Check(
        "file_imports",
        "your lab file imports",
        False,
        f"{_short(path)} did not import{where}: {info['error']}: {info['message']}",
        hint="code at the top level of your file runs when it is imported: a loop or a blocking call "
        "there keeps the process from starting; move it into a function"
        if started
        else "fix that line first; the grader cannot run code that does not import",
    )


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
