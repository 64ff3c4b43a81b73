"""Shared fixtures and hooks for every test and notebook (at the root, so running one notebook loads it too).

Every broker here is a real nats-server process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from msglab.broker.server import EmbeddedServer

ROOT = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Checks run by tests and notebooks record their attempts in a throwaway folder, never the checkout's."""
    import tempfile

    os.environ["MSGLAB_STATE_DIR"] = tempfile.mkdtemp(prefix="msglab-test-state-")


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
