"""A planned fault lands on the workload (issue 15): once a grader registers the keys of the messages it
published (`run.workload.add(key)`), effect calls about anything else are decoys that no crash point
counts, and `run.workload_check()` fails a run whose effects name things that do not exist. Shown on
the example lab (examples/00_echo), with the registration added the way a grader or scaffold adds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from msglab.catalog import course_root, load_lab
from msglab.grading import example
from msglab.grading.grade import grade
from msglab.grading.harness import Run
from msglab.grading.scaffold import Topology
from msglab.grading.verdict import Verdict

EXAMPLE = load_lab(course_root() / "examples" / "00_echo")
ACKS_FIRST = (EXAMPLE.folder / "variants" / "acks_first.py").read_text()
# The same wrong worker (acks before it echoes), after three echo calls about messages that do not
# exist: every crash the plan puts on its first three echo calls lands while it holds no message.
DECOYS = (
    ACKS_FIRST.replace("async def echo_worker(env)", "async def _acks_first(env)")
    + """

async def echo_worker(env) -> None:
    for n in range(3):
        await env.echo(f"no-such-{n}", "decoy")
    await _acks_first(env)
"""
)


# The same wrong worker after echo calls about real messages it never took: it waits until the stream has the
# latest three (keys named as the grader names them, m-1, m-2, ...) and calls about those, holding none of them.
UNHELD = (
    ACKS_FIRST.replace("async def echo_worker(env)", "async def _acks_first(env)")
    + """

async def echo_worker(env) -> None:
    import asyncio

    while (stored := (await env.js.stream_info(env.stream("ECHO"))).state.last_seq) < 3:
        await asyncio.sleep(0.01)
    for n in range(stored - 2, stored + 1):
        await env.echo(f"m-{n}", "not taken")
    await _acks_first(env)
"""
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adoption: each published message's key registered (the hook), and the platform's check judged."""
    publish = Topology.publish

    async def publish_and_register(self: Topology, run: Run, body: bytes, subject: str | None = None) -> int:
        run.workload.add(json.loads(body)["id"])  # the one line: the key of what is published
        return await publish(self, run, body, subject)

    async def grade_with_check(run: Run) -> list[Any]:
        return [*await real(run), run.workload_check("echo")]

    real = example.grade
    monkeypatch.setattr(Topology, "publish", publish_and_register)
    monkeypatch.setattr(example, "grade", grade_with_check)


def _graded(tmp_path: Path, source: str, seed: int) -> Verdict:
    path = tmp_path / EXAMPLE.file
    path.write_text(source)
    return grade(EXAMPLE, source=path, seed=seed)


def _failed(verdict: Verdict) -> set[str]:
    return {check.name for check in verdict.failures}


@pytest.mark.parametrize("seed", [1, 2])
def test_decoy_calls_absorb_the_crashes_until_the_workload_is_registered(
    no_nats_url: None, tmp_path: Path, seed: int
) -> None:
    assert "every_message_echoed" in _failed(_graded(tmp_path, ACKS_FIRST, seed))  # the control
    dodged = _graded(tmp_path, DECOYS, seed)
    assert dodged.passed, dodged.to_text()  # the trick, on a grader that registers nothing


@pytest.mark.parametrize("seed", [1, 2])
def test_with_the_workload_registered_the_crashes_land_on_real_work(
    no_nats_url: None, registered: None, tmp_path: Path, seed: int
) -> None:
    control = _graded(tmp_path, ACKS_FIRST, seed)
    assert _failed(control) == {"every_message_echoed"}, control.to_text()
    verdict = _graded(tmp_path, DECOYS, seed)
    assert {"every_message_echoed", "effects_on_the_workload"} <= _failed(verdict), verdict.to_text()
    decoys = next(c for c in verdict.failures if c.name == "effects_on_the_workload")
    assert "no-such-0" in decoys.message and "faults_fired" not in _failed(verdict)
    solution = grade(EXAMPLE, solution=True, seed=seed)
    assert solution.passed and "effects_on_the_workload" in {c.name for c in solution.checks}, solution.to_text()


@pytest.fixture
def held(registered: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adoption of Workload.held: echo calls count only about a message delivered to the calling process."""
    real = example.grade

    async def grade_held(run: Run) -> list[Any]:
        run.workload.held("echo")
        return await real(run)

    monkeypatch.setattr(example, "grade", grade_held)


@pytest.mark.parametrize("seed", [1, 2])
def test_calls_about_real_messages_it_never_took_absorb_the_crashes_unless_held_is_asked(
    no_nats_url: None, registered: None, tmp_path: Path, seed: int
) -> None:
    dodged = _graded(tmp_path, UNHELD, seed)
    # The trick: every message echoed before anything was taken, so a kill on those calls loses nothing.
    assert not {"every_message_echoed", "effects_on_the_workload"} & _failed(dodged), dodged.to_text()


@pytest.mark.parametrize("seed", [1, 2])
def test_with_held_asked_the_crashes_land_on_messages_the_process_was_delivered(
    no_nats_url: None, held: None, tmp_path: Path, seed: int
) -> None:
    control = _graded(tmp_path, ACKS_FIRST, seed)
    assert _failed(control) == {"every_message_echoed"}, control.to_text()
    verdict = _graded(tmp_path, UNHELD, seed)
    assert "effects_on_the_workload" in _failed(verdict), verdict.to_text()
    (check,) = [c for c in verdict.failures if c.name == "effects_on_the_workload"]
    assert "the server never delivered" in check.message, check.message
    solution = _graded(tmp_path, (EXAMPLE.folder / "solution" / EXAMPLE.file).read_text(), seed)
    assert solution.passed, solution.to_text()
