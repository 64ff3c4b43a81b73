"""Tricks on the platform itself, each beside its control (the same wrong file without the trick):
a wrong file that reconfigures the platform's durable, or floods and steers a course service, still
fails for its own mistake, and the verdict stays a verdict (never the grader's error, exit 2)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import PRELUDE, mark_folder

from msglab.catalog import Lab, all_labs
from msglab.grading.grade import GRADE_TIMEOUT, grade
from msglab.grading.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent
LAB04 = next(lab for lab in all_labs() if lab.number == "04")

# Lab 04's wrong variant that retries at a fixed pace, made to nak with no delay at all: it burns
# an email's budget at once, unless a backoff on the durable (the server applies it to a plain nak)
# spaces the retries for it.
FIXED_PACE = (ROOT / "tests/variants/04_poison_messages/fixed_delay.py").read_text()
NO_DELAY = FIXED_PACE.replace("await msg.nak(delay=0.3)", "await msg.nak()")
assert NO_DELAY != FIXED_PACE

BACKOFF_ON_THE_PLATFORM_DURABLE = """
import asyncio as _asyncio

async def _reconfigure(env):
    info = await env.js.consumer_info(env.stream("EMAILS"), env.durable("email"))
    config = info.config
    config.backoff = [0.1, 0.2, 0.4, 0.8, 1.6][: max(1, (config.max_deliver or 5) - 1)]
    for how, call in (
        ("named", lambda: env.js.add_consumer(env.stream("EMAILS"), config, timeout=1)),
        ("unnamed", lambda: env.nc.request(f"$JS.API.CONSUMER.CREATE.{env.stream('EMAILS')}", __import__("json").dumps(
            {"stream_name": env.stream("EMAILS"), "config": {**config.as_dict(), "durable_name": None}}).encode(),
            timeout=1)),
    ):
        try:
            reply = await _asyncio.wait_for(call(), 1.5)
            error = b'"error"' in getattr(reply, "data", b"")
            _report(f"outcome {'refused by the server' if error else 'durable reconfigured'} {how}")
        except Exception as exc:
            _report(f"outcome refused {how} {type(exc).__name__}")
_hostile(_reconfigure, once=True)
"""

FLOOD_AND_STEER_THE_PROVIDER = """
import asyncio as _asyncio

async def _flood(env):
    email = b'{"to": "flood@example.com", "template": "order_confirmation", "order_id": "o-x"}'
    try:
        await env.nc.publish(env.subject("provider.control"), b'{"op": "reset"}')  # end outages, drop scripts
        for i in range(30_000):
            reply = env.nc.new_inbox() if i % 2 else ""
            await env.nc.publish(env.subject("provider.send"), email, reply=reply)
        await env.nc.flush(timeout=5)
        _report("outcome sent the flood")
    except Exception as exc:
        _report(f"outcome refused flood {type(exc).__name__}")
_hostile(_flood, once=True)
"""


def _graded(lab: Lab, source: str, mark: Path, trick: str = "") -> Verdict:
    folder = Path(tempfile.mkdtemp(prefix="msglab-platform-src-"))
    path = folder / lab.file
    path.write_text(source + PRELUDE.format(mark=str(mark)) + trick)
    try:
        return grade(lab.number, source=path, seed=1)  # a GraderError (exit 2) would raise here
    finally:
        path.unlink()
        folder.rmdir()


def _failed(verdict: Verdict) -> list[str]:
    return [check.name for check in verdict.checks if not check.passed]


def _outcomes(mark: Path) -> list[str]:
    said = [p.read_text() for p in sorted(mark.iterdir()) if not p.name.endswith(".part")]
    for report in mark.iterdir():
        report.unlink()
    return [word for word in said if word.startswith("outcome ")]


def test_a_backoff_set_on_the_platform_durable_does_not_make_a_worker_without_delays_pass(no_nats_url: None) -> None:
    mark = mark_folder("msglab-platform-")
    try:
        control = _graded(LAB04, NO_DELAY, mark)
        assert not control.passed, control.to_text()
        verdict = _graded(LAB04, NO_DELAY, mark, BACKOFF_ON_THE_PLATFORM_DURABLE)
        outcomes = _outcomes(mark)
    finally:
        mark.rmdir()
    assert outcomes and all(o.startswith("outcome refused") for o in outcomes), outcomes
    assert set(_failed(control)) & set(_failed(verdict)), verdict.to_text()  # its own mistake still fails it


def test_flooding_and_steering_the_email_provider_leaves_a_failing_verdict_not_a_grading_error(
    no_nats_url: None,
) -> None:
    mark = mark_folder("msglab-platform-")
    starter = LAB04.source().read_text()
    try:
        control = _graded(LAB04, starter, mark)
        verdict = _graded(LAB04, starter, mark, FLOOD_AND_STEER_THE_PROVIDER)
        outcomes = _outcomes(mark)
    finally:
        mark.rmdir()
    assert not control.passed and not verdict.passed, verdict.to_text()
    assert outcomes, "the flood never ran"
    assert verdict.seconds < GRADE_TIMEOUT, verdict.to_text()
    # The starter's own mistakes still fail it (which of them shows can follow the machine's timing).
    assert set(_failed(control)) & set(_failed(verdict)), verdict.to_text()
    assert "finishes" not in _failed(verdict), verdict.to_text()
