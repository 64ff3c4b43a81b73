"""Shared fixtures: every broker here is a real nats-server process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from msglab.broker.server import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent


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
