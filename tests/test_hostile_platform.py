"""Tricks on the platform itself, each beside its control (the same wrong file without the trick):
a wrong file that reconfigures the platform's durable, floods and steers a course service, or stores
300 MB into the platform's stream still fails for its own mistake, and the verdict stays a verdict
(never the grader's error, exit 2); what it stored is refused at the run's bound and gone afterwards."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import PRELUDE, mark_folder

from msglab.broker.server import STORE_PREFIX, EmbeddedServer
from msglab.broker.users import RUN_JETSTREAM, SLOT_JETSTREAM, SLOTS, SharedUsers, slot_grader_url
from msglab.catalog import Lab, all_labs
from msglab.grading.grade import GRADE_TIMEOUT, grade
from msglab.grading.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent
LAB04 = next(lab for lab in all_labs() if lab.number == "04")
LAB01 = next(lab for lab in all_labs() if lab.number == "01")
ACK_BEFORE_WORK = (ROOT / "tests/variants/01_request_reply_vs_events/ack_before_work.py").read_text()

# The grader's requests to the email provider and the provider's answers (the grader's inbox), overheard.
OVERHEAR_THE_GRADER = """
async def _overhear(env):
    heard = []

    async def _note(msg):
        grader = msg.subject.startswith(("_INBOX.", "$SYS.")) or "provider." in msg.subject or "gateway." in msg.subject
        if grader and len(heard) < 3:
            heard.append(msg.subject)
            _report(f"outcome heard {msg.subject}")

    for subject in ("_INBOX.>", ">", env.subject("provider.>"), env.subject("gateway.>")):
        try:
            await env.nc.subscribe(subject, cb=_note)
        except Exception as exc:
            _report(f"outcome refused {subject} {type(exc).__name__}")
    await env.nc.flush()
    _report("outcome refused: listening")  # anything of the grader's it hears from here on is reported
_hostile(_overhear, once=True)
"""

# 300 MB into the platform's stream (lab 01's ORDERS stores every orders.> subject), 256 KB a message.
HOG_THE_STREAM = """
async def _hog(env):
    chunk, stored = b"x" * (256 << 10), 0
    try:
        while stored < (300 << 20):
            await env.js.publish(env.subject("orders.hog"), chunk, timeout=2)
            stored += len(chunk)
        _report(f"outcome stored {stored >> 20} MB")
    except Exception as exc:
        _report(f"outcome refused after {stored / (1 << 20):.1f} MB: {exc}")
_hostile(_hog, once=True)
"""

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


def _beside_its_control(lab: Lab, source: str, trick: str) -> tuple[Verdict, Verdict, list[str]]:
    """The wrong file graded without the trick (the control) and with it, and what the trick reported."""
    mark = mark_folder("msglab-platform-")
    try:
        control = _graded(lab, source, mark)
        _outcomes(mark)  # the control reports nothing of the trick's
        return control, _graded(lab, source, mark, trick), _outcomes(mark)
    finally:
        mark.rmdir()


def test_a_backoff_set_on_the_platform_durable_does_not_make_a_worker_without_delays_pass(no_nats_url: None) -> None:
    control, verdict, outcomes = _beside_its_control(LAB04, NO_DELAY, BACKOFF_ON_THE_PLATFORM_DURABLE)
    assert not control.passed, control.to_text()
    assert outcomes and all(o.startswith("outcome refused") for o in outcomes), outcomes
    assert set(_failed(control)) & set(_failed(verdict)), verdict.to_text()  # its own mistake still fails it


def test_flooding_and_steering_the_email_provider_leaves_a_failing_verdict_not_a_grading_error(
    no_nats_url: None,
) -> None:
    control, verdict, outcomes = _beside_its_control(LAB04, LAB04.source().read_text(), FLOOD_AND_STEER_THE_PROVIDER)
    assert not control.passed and not verdict.passed, verdict.to_text()
    assert outcomes, "the flood never ran"
    assert verdict.seconds < GRADE_TIMEOUT, verdict.to_text()
    # The starter's own mistakes still fail it (which of them shows can follow the machine's timing).
    assert set(_failed(control)) & set(_failed(verdict)), verdict.to_text()
    assert "finishes" not in _failed(verdict), verdict.to_text()


def test_a_worker_overhearing_the_graders_requests_to_the_provider_hears_nothing_and_still_fails(
    no_nats_url: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from msglab.broker.users import RunUsers

    starter = LAB04.source().read_text()
    control, verdict, outcomes = _beside_its_control(LAB04, starter, OVERHEAR_THE_GRADER)
    # The trick's own control: a learner user without permissions hears the grader ask the provider.
    mark = mark_folder("msglab-platform-")
    try:
        with monkeypatch.context() as patch:
            patch.setattr(RunUsers, "learner_permissions", lambda self: {})
            _graded(LAB04, starter, mark, OVERHEAR_THE_GRADER)
        unguarded = _outcomes(mark)
    finally:
        mark.rmdir()
    assert any(o.startswith("outcome heard") for o in unguarded), unguarded
    assert not control.passed and not verdict.passed, verdict.to_text()
    assert outcomes and all(o.startswith("outcome refused") for o in outcomes), outcomes
    assert set(_failed(control)) & set(_failed(verdict)), verdict.to_text()


@pytest.fixture(params=["own server", "shared server"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A run's own server (no NATS_URL), or a slot of a shared server msglab started (NATS_URL: the admin's)."""
    monkeypatch.delenv("NATS_URL", raising=False)
    if request.param == "own server":
        yield request.param, ""
        return
    users = SharedUsers()
    folder = tempfile.mkdtemp(prefix="msglab-shared-hog-")
    config = os.path.join(folder, "server.conf")
    Path(config).write_text(users.config())
    with EmbeddedServer(config=config) as server:
        admin = users.admin_url(server.url)
        monkeypatch.setenv("NATS_URL", admin)
        yield request.param, admin
    os.unlink(config)
    os.rmdir(folder)


async def _slots_storage(admin: str) -> list[tuple[int, int]]:
    """(streams, bytes) every slot's account holds."""
    held = []
    for slot in range(1, SLOTS + 1):
        nc = await nats.connect(slot_grader_url(admin, slot))
        info = await nc.jetstream().account_info()
        held.append((info.streams, info.storage))
        await nc.close()
    return held


def test_storing_300_mb_into_the_platforms_stream_is_refused_at_the_bound_and_the_wrong_file_still_fails(
    where: tuple[str, str],
) -> None:
    kind, admin = where
    bound = RUN_JETSTREAM["max_file"] if kind == "own server" else SLOT_JETSTREAM["max_file"]
    stores = {str(p) for p in Path(tempfile.gettempdir()).glob(f"{STORE_PREFIX}{os.getpid()}-*")}
    control, verdict, outcomes = _beside_its_control(LAB01, ACK_BEFORE_WORK, HOG_THE_STREAM)
    assert not control.passed and "no_lost_emails" in _failed(control), control.to_text()
    assert not verdict.passed and "no_lost_emails" in _failed(verdict), verdict.to_text()  # its own mistake
    # Each of its processes hogs once: together they store at most the bound, then the server refuses.
    assert outcomes and all(o.startswith("outcome refused after") for o in outcomes), outcomes
    assert all("err_code=10002" in o for o in outcomes), outcomes  # resource limits exceeded for account
    assert sum(float(o.split()[3]) for o in outcomes) <= bound >> 20, outcomes
    # Nothing it stored outlives the verdict: the run's own server and its store are gone, or the slot is empty.
    assert {str(p) for p in Path(tempfile.gettempdir()).glob(f"{STORE_PREFIX}{os.getpid()}-*")} <= stores
    if admin:
        assert "enforced by its user" in verdict.server, verdict.server
        assert asyncio.run(_slots_storage(admin)) == [(0, 0)] * SLOTS
