"""Shared fixtures and hooks for every test and notebook (at the root, so running one notebook loads it too).

Every broker here is a real nats-server process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from msglab.broker.server import EmbeddedServer

ROOT = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Checks run by tests and notebooks record their attempts in a throwaway folder, never the checkout's;
    every grading run in a test process is counted."""
    import tempfile

    os.environ["MSGLAB_STATE_DIR"] = tempfile.mkdtemp(prefix="msglab-test-state-")
    # One fixed fault-plan key: a test's seed draws the same plan on every machine (msglab.grading.nemesis).
    os.environ.setdefault("MSGLAB_PLAN_KEY", "msglab test suite")
    if not hasattr(config, "workerinput"):  # the controller: its xdist workers inherit the folder
        os.environ[VERDICT_LOG] = tempfile.mkdtemp(prefix="msglab-test-verdicts-")
    _count_grading_runs()


VERDICT_LOG = "MSGLAB_TEST_VERDICTS"  # a folder: one file per test process, a line per test that graded
_graded = [0]  # grading runs so far in this process (tests grade from threads: a lock guards it)
_graded_lock = threading.Lock()


def _count_grading_runs() -> None:
    """Count each run of a lab's grader made in this process (a verdict of a file that imports: the
    cost `make test` pays). Runs in subprocesses (`msglab check`, notebooks, class gradebooks) are not."""
    from msglab.grading import grade as grading

    real = grading._grade

    async def counted(*args: Any, **kwargs: Any) -> Any:
        with _graded_lock:
            _graded[0] += 1
        return await real(*args, **kwargs)

    grading._grade = counted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # The whole protocol, so a module fixture's gradings count too (test_variants_under_load.py's).
    before = _graded[0]
    try:
        return (yield)
    finally:
        if _graded[0] > before and os.environ.get(VERDICT_LOG):
            with open(Path(os.environ[VERDICT_LOG]) / f"{os.getpid()}.tsv", "a") as log:
                log.write(f"{item.nodeid}\t{_graded[0] - before}\n")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """How many grading runs the tests made, in all and by file (what a run of the suite costs)."""
    folder = os.environ.get(VERDICT_LOG, "")
    if hasattr(config, "workerinput") or not folder or not Path(folder).is_dir():
        return
    by_file: dict[str, int] = {}
    for log in Path(folder).glob("*.tsv"):
        for line in log.read_text().splitlines():
            nodeid, count = line.rsplit("\t", 1)
            name = nodeid.split("::")[0]
            by_file[name] = by_file.get(name, 0) + int(count)
    if by_file:
        files = ", ".join(f"{name} {n}" for name, n in sorted(by_file.items(), key=lambda kv: -kv[1]))
        terminalreporter.write_line(f"grading runs in test processes: {sum(by_file.values())} ({files})")


def pytest_report_header(config: pytest.Config) -> str:
    if str(ROOT / "tests") not in sys.path:  # where the test modules import it from, once collected
        sys.path.insert(0, str(ROOT / "tests"))
    from verdicts import DEPTH, ROUND

    if DEPTH == "deep":
        return "msglab: a deep run (every seed, every known file under load, every hostile case)"
    return (
        f"msglab: a quick run, round {ROUND:08x} (each known file on one of its seeds, a share under load"
        " and of the hostile corpus); MSGLAB_TEST_DEPTH=deep grades everything"
    )


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: three workers per core, at most twelve.

    Most of a test's time is a grader's or a demo's timers (ack_wait, fault timers, deadlines for
    hostile code), not CPU: with two workers per core the cores were busy 58 % of a run. The
    verdicts themselves share SLOTS (tests/verdicts.py) whatever the number of workers.
    """
    return max(2, min(12, 3 * (os.cpu_count() or 1)))


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    shutil.rmtree(os.environ.get("MSGLAB_STATE_DIR", ""), ignore_errors=True)
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.get(VERDICT_LOG, ""), ignore_errors=True)


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedServer]:
    """One real JetStream server for tests that only need a broker."""
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture
def no_nats_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure a developer's own NATS_URL cannot change what a test sees."""
    monkeypatch.delenv("NATS_URL", raising=False)


@pytest.fixture
def reaped() -> Iterator[list[subprocess.Popen[str]]]:
    """A list for the long-running commands a test starts (`msglab server`, `watch`, `classroom serve`): any still
    running when the test ends, passed or failed, is killed (its nats-server dies with it: PR_SET_PDEATHSIG)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m msglab ...` as a learner would, and capture what it prints."""
    full_env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "msglab", *args], capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=timeout
    )


@pytest.hookimpl(trylast=True)  # after -k and -m: a lesson is left to nbval unless its browser test runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep what must share a worker on one xdist worker (`--dist loadgroup`), longest work first.

    A notebook's cells run in order in one kernel, so each notebook is one group; the CPU-load
    module is one group, so only one set of spinners runs; the browser tests run on BROWSER_LABS
    JupyterLabs, each a group, the lessons shared between them by size. A lesson the browser test runs (all its
    cells, in JupyterLab) is not run again under nbval in the same session. The groups that take
    longest go to the workers first, so none starts last and finishes alone (pyproject keeps xdist
    from reordering them by test count).
    """
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers only
        return
    _skip_lessons_the_browser_runs(config, items)
    browser = _browser_groups([item for item in items if Path(str(item.fspath)).name == "test_browser.py"])
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            _group(item, f"nb-{path.parent.name}-{path.stem}")
        elif path.name == "test_browser.py":
            _group(item, browser[item.nodeid])
        elif path.name in ("test_variants_under_load.py", "test_make_lab.py"):
            _group(item, path.stem)
    weight: dict[str, float] = {}
    for item in items:
        weight[_unit(item)] = weight.get(_unit(item), 0.0) + _seconds(item)
    items.sort(key=lambda item: -weight[_unit(item)])


def _unit(item: pytest.Item) -> str:
    """What xdist hands a worker at once: the item's group, or the item alone."""
    return item.nodeid.rsplit("@", 1)[-1] if "@" in item.nodeid else item.nodeid


# Rough seconds a test takes on a 2-core machine (measured 1 Dec 2026 with others' work beside it),
# for the order work is handed out in: only the order matters, not the numbers. Unlisted: 1 s.
SECONDS = {
    "test_browser.py": 25.0,  # a lesson in JupyterLab (14-34 s), plus the lab's start
    "test_variants_under_load.py": 19.0,  # a lab's known files, four at once under load
    "test_variants.py": 6.0 if os.environ.get("MSGLAB_TEST_DEPTH") == "deep" else 2.5,  # a file on its seeds
    "test_hostile.py": 6.0,
    "test_reproducible.py": 10.0,  # a wrong file graded twice at once
    "test_demo_idempotency.py": 10.0,
    "test_classroom.py": 5.0,
    "test_release.py": 5.0,
    "test_environment.py": 4.0,
    ".ipynb": 2.0,  # a notebook cell (a lesson under nbval: 30-60 s under load)
}


# Single tests far longer than their file's others (a full quick run, 2 Dec 2026): started first, so
# none of them is left running alone at the end.
LONG = {
    "test_the_editions_make_test_is_green_in_a_fresh_venv": 40.0,
    "test_lesson_00_runs_three_times_at_once_on_a_tls_room_each_learner_joined_from_a_handout": 80.0,
    "test_the_grader_grades_every_lab_on_every_python_present": 75.0,
    "test_a_starter_that_passes_its_lab_stops_the_release": 35.0,
    "test_the_autograder_bundle_runs_in_a_platform_shaped_folder": 35.0,
    "test_a_generated_class_is_graded_end_to_end_with_the_right_scores": 30.0,
    "test_a_greeting_without_tls_gets_no_password_from_the_course_once_it_knows_the_rooms_ca": 35.0,
    # Do-nothing files: the grader waits out every phase's cap for work that never comes (20-40 s).
    **{
        f"test_known_file_gets_its_expected_verdict_on_its_seeds[{lab}-blocks_forever]": 30.0
        for lab in ("02", "04", "06", "07")
    },
}


# How much longer a lab's verdict takes than most (same run): its files are handed out first, so the
# run does not end with a lab 06 file graded alone.
LAB_WEIGHT = {"05": 3.0, "06": 3.5, "07": 1.4}


def _seconds(item: pytest.Item) -> float:
    path = Path(str(item.fspath))
    name = getattr(item, "originalname", item.name)
    lab = item.name.partition("[")[2][:2]  # a test of one lab's file: its id starts with the lab's number
    weight = LAB_WEIGHT.get(lab, 1.0) if path.name in SECONDS and lab.isdigit() else 1.0
    return LONG.get(item.name) or LONG.get(name) or weight * SECONDS.get(path.name, SECONDS.get(path.suffix, 1.0))


def _lesson_of(item: pytest.Item) -> str:
    """The lesson a browser test runs ('' for its self-tests)."""
    lesson = item.callspec.params.get("lesson", "") if hasattr(item, "callspec") else ""
    return Path(str(lesson)).stem


def _browser_can_run() -> bool:
    """What tests/test_browser.py needs, or it skips (then nbval must run every lesson)."""
    import importlib.util

    return os.path.exists("/usr/bin/chromium") and importlib.util.find_spec("playwright") is not None


def _skip_lessons_the_browser_runs(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the nbval cells of each lesson that a browser test of this session runs to the end:
    it runs every cell in a kernel too, and fails on any error output (what nbval-lax checks), so
    running it twice costs time and checks nothing more."""
    if not _browser_can_run():
        return
    in_browser = {_lesson_of(i) for i in items if Path(str(i.fspath)).name == "test_browser.py"} - {""}
    twice = [i for i in items if Path(str(i.fspath)).suffix == ".ipynb" and Path(str(i.fspath)).parent.name ==
             "lessons" and Path(str(i.fspath)).stem in in_browser]  # fmt: skip
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [i for i in items if i not in set(twice)]


BROWSER_LABS = 3  # with two, each ran about 4.5 min of lessons, the longest path through a run
# Seconds a lesson took in the browser during a full run (2 Dec 2026); a lesson not listed counts
# 2.5 s a code cell. Only how they compare matters: it shares the lessons out evenly.
BROWSER_SECONDS = {"00": 41, "01": 73, "02": 60, "03": 41, "04": 107, "05": 100, "06": 63}


def _browser_groups(tests: list[pytest.Item]) -> dict[str, str]:
    """BROWSER_LABS JupyterLabs, each a group on a worker of its own: lessons shared out longest first (by
    BROWSER_SECONDS) to the lightest one; the self-tests go with the lightest."""
    import json
    import math

    def cells(item: pytest.Item) -> float:
        lesson = ROOT / "lessons" / f"{_lesson_of(item)}.ipynb"
        if not lesson.is_file():
            return 15  # a self-test
        if lesson.stem[:2] in BROWSER_SECONDS:
            return BROWSER_SECONDS[lesson.stem[:2]]
        return 2.5 * sum(c.get("cell_type") == "code" for c in json.loads(lesson.read_text()).get("cells", []))

    # As many JupyterLabs as there are about 2.5 minutes of lessons for (each costs about 20 s of CPU to
    # start), at most BROWSER_LABS.
    load = [0.0] * max(1, min(BROWSER_LABS, math.ceil(sum(map(cells, tests)) / 150)))
    groups = {}
    for item in sorted(tests, key=lambda i: (-cells(i), i.nodeid)):
        lab = load.index(min(load))
        load[lab] += cells(item)
        groups[item.nodeid] = f"test_browser-{lab}"
    return groups


def _group(item: pytest.Item, name: str) -> None:
    """Put item in xdist group `name` by the id suffix xdist's scheduler reads.

    pytest-xdist 3.8 marks groups by rewriting `item._nodeid`, which pytest 9.2 no longer reads
    (a node's id is `item._id` now), so its xdist_group marker groups nothing here.
    """
    from _pytest.nodeid import coerce_node_id

    if "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{name}")
