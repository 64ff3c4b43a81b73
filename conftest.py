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
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
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


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two workers per core, at most twelve.

    Most of a test's time is a grader's or a demo's timers (ack_wait, fault timers, deadlines for
    hostile code), not CPU. On 2 cores, 6 workers ran the suite in 5 min 50 s but some lesson
    demos, which measure rates, failed under that load now and then; 4 keep them green.
    """
    return max(2, min(12, 2 * (os.cpu_count() or 1)))


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


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m msglab ...` as a learner would, and capture what it prints."""
    full_env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "msglab", *args], capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=timeout
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep what must share a worker on one xdist worker (`--dist loadgroup`).

    A notebook's cells run in order in one kernel, so each notebook is one group; the CPU-load
    module is one group, so only one set of spinners runs; the browser and JupyterLab tests
    each share a worker with their module.
    """
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers only
        return
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":
            _group(item, f"nb-{path.parent.name}-{path.stem}")
        elif path.name == "test_browser.py":
            # Two JupyterLabs, each on a worker of its own, share the lessons: odd and even numbers.
            lesson = item.callspec.params.get("lesson", "") if hasattr(item, "callspec") else ""
            number = Path(str(lesson)).name[:2]
            _group(item, f"test_browser-{int(number) % 2 if number.isdigit() else 0}")
        elif path.name in ("test_variants_under_load.py", "test_make_lab.py"):
            _group(item, path.stem)


def _group(item: pytest.Item, name: str) -> None:
    """Put item in xdist group `name` by the id suffix xdist's scheduler reads.

    pytest-xdist 3.8 marks groups by rewriting `item._nodeid`, which pytest 9.2 no longer reads
    (a node's id is `item._id` now), so its xdist_group marker groups nothing here.
    """
    from _pytest.nodeid import coerce_node_id

    if "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{name}")
