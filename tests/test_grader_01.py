"""Lab 01's grader judged on real runs: what its verdicts say, and that each rule's evidence is in them.

Whether the starter, the solution and every variant get their expected verdict, and what a variant's
verdict says (its `Says:` lines), on five seeds, is tests/test_variants*.py; here, the starter's story,
the evidence behind a passing run, and files made in a test to exercise one grader behaviour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from msglab.graders import request_reply_vs_events as lab01
from msglab.grading.grade import grade
from msglab.grading.verdict import Check, Verdict

SOLUTION = Path(__file__).resolve().parent.parent / "solutions" / "01_request_reply_vs_events" / "orders.py"


def failed(verdict: Verdict, name: str) -> Check:
    """The failing check `name`, or a test failure that shows the whole verdict."""
    check = next((c for c in verdict.failures if c.name == name), None)
    assert check is not None, f"{name} did not fail:\n{verdict.to_text()}"
    return check


def variant_of_solution(tmp_path: Path, old: str, new: str) -> Path:
    """The reference solution with one piece replaced: a wrong variant made for one test."""
    text = SOLUTION.read_text()
    assert old in text
    path = tmp_path / "orders.py"
    path.write_text(text.replace(old, new))
    return path


def test_starter_fails_and_teaches_temporal_coupling(no_nats_url: None) -> None:
    verdict = grade("01", seed=3)
    down = failed(verdict, "accepts_while_email_down")
    assert "NoRespondersError" in down.message  # the evidence: what place_order raised
    assert "temporal coupling" in down.message
    assert "announce the order" in down.hint
    silent = failed(verdict, "accepts_while_loyalty_silent")
    assert "received place_order's request" in silent.message and "never answered" in silent.message
    assert "merely reacts" in silent.hint
    early = failed(verdict, "refuses_inventory_silent")
    assert "before env.request_timeout (0.8 s)" in early.message
    assert all(c.message and c.hint for c in verdict.failures)
    # Nothing is claimed that did not happen: the starter's worker never asked the durable for anything.
    idle = failed(verdict, "survives_idle")
    assert "never asked the durable 'email'" in idle.message
    assert "survived" not in idle.message


def test_a_passing_run_shows_every_rule_at_work(no_nats_url: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[lab01.Evidence] = []
    judge = lab01.judge

    def spy(ev: lab01.Evidence) -> list[Check]:
        seen.append(ev)
        return judge(ev)

    monkeypatch.setattr(lab01, "judge", spy)
    verdict = grade("01", solution=True, seed=7)
    assert verdict.passed, verdict.to_text()
    assert verdict.seconds < 10  # about 2 s idle: no deadline was waited out
    ev = seen[0]
    run, plan = ev.run, ev.plan
    # Rule 1: both planned SIGKILLs of the email worker fired, one before an email and one after.
    assert sorted(e.detail["when"] for e in run.log.events("crash", "send_email")) == ["after", "before"]
    # Rule 4: the order placed while the stream refused was refused by place_order, with the stream's error.
    refused = plan.one("stream_refused")
    assert not refused.accepted and refused.value["error"] == "ServiceUnavailableError"
    # Rule 5: the silent inventory was waited for env.request_timeout, which is not nats-py's default.
    assert lab01.PARAMS["request_timeout"] != 0.5
    assert plan.one("inventory_silent").elapsed >= lab01.REQUEST_TIMEOUT
    # Rule 6: the kill after an email made one order go out twice, and the broker's evidence allowed it.
    emails = lab01._emails(run)
    twice = [oid for oid, sent in emails.items() if len(sent) > 1]
    assert twice, "the crash after an email should have made the solution send one twice"
    allowance = lab01._allowance(run, ev.watch, ev.stream, ev.email.ended, twice[0])
    assert allowance.allowed == len(emails[twice[0]]) and allowance.held
    # The transfer: the provider refused worker #3's first emails, and each of those orders was emailed later.
    outage = ev.provider.refused
    assert len(outage) == lab01.OUTAGE_CALLS and {e.pid for e in outage} == {ev.last_worker.pid}
    assert all(any(sent.ts > e.ts for sent in emails[str(e.key)]) for e in outage)
    # Rule 2: the backlog drained, the last worker asked again after an empty fetch, and emailed the late order itself.
    proof = ev.idle.proof
    assert proof.drained and proof.refetch is not None and proof.refetch.ts > proof.since
    late = emails[plan.one("late").id]
    assert [e.pid for e in late] == [ev.last_worker.pid]


def test_a_worker_that_stops_asking_after_an_empty_fetch_is_caught(no_nats_url: None, tmp_path: Path) -> None:
    # Survives, but waits for a signal that never comes once the backlog is done.
    path = variant_of_solution(
        tmp_path,
        "size.)\n            continue\n",  # the empty fetch's continue, not the refused email's
        "size.)\n            await asyncio.Event().wait()\n",
    )
    path.write_text("import asyncio\n" + path.read_text())
    verdict = grade("01", source=path, seed=1)
    idle = failed(verdict, "survives_idle")
    assert "was never followed by another: it did not ask again after an empty fetch" in idle.message
    assert "no_unplanned_deaths" not in {c.name for c in verdict.failures}  # it is alive, just deaf


def test_a_hung_place_order_is_stopped_and_what_was_not_tested_is_said(no_nats_url: None, tmp_path: Path) -> None:
    path = variant_of_solution(
        tmp_path,
        '    await env.js.publish(env.subject("orders.placed"), data)\n',
        '    await env.js.publish(env.subject("orders.placed"), data)\n    await asyncio.Event().wait()\n',
    )
    path.write_text("import asyncio\n" + path.read_text())
    verdict = grade("01", source=path, seed=1)
    up = failed(verdict, "accepts_with_services_up")
    assert "did not return within 3 s (the grader stopped it)" in up.message
    down = failed(verdict, "refuses_inventory_down")
    assert down.message.startswith("could not be tested")
    assert verdict.seconds < 30  # two hung calls, then no more orders: no 60 s grading timeout


def test_the_learner_may_ask_the_course_inventory_and_loyalty_but_never_answer_for_them(tmp_path: Path) -> None:
    # Lab 01's declarations make the learner user an allow-list (msglab.broker.users): its own subjects,
    # requests to the course's services, the JetStream API on ORDERS; the harness applies it per lab.
    import asyncio

    import nats

    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import LEARNER_INBOX, RunUsers

    users = RunUsers(grader=lab01)
    config = tmp_path / "server.conf"
    config.write_text(users.config())

    async def body(url: str) -> dict[str, str]:
        grader = await nats.connect(users.grader_url(url))
        learner = await nats.connect(users.learner_url(url), inbox_prefix=LEARNER_INBOX, allow_reconnect=False)
        out: dict[str, str] = {}
        try:
            heard: list[str] = []

            async def note(msg: Any) -> None:
                heard.append(msg.subject)
                if msg.reply:
                    await msg.respond(b'{"reserved": true}')

            await grader.subscribe("loyalty.award", cb=note)
            await learner.subscribe("inventory.reserve", cb=note)  # answering for the inventory: refused
            await learner.subscribe("email.send", cb=note)  # an email service of its own, as the starter's
            await learner.flush()
            await grader.flush()
            for who, subject in ((learner, "loyalty.award"), (grader, "inventory.reserve"), (grader, "email.send")):
                try:
                    await who.request(subject, b'{"id": "o-1"}', timeout=2)
                    out[subject] = "answered"
                except nats.errors.NoRespondersError:
                    out[subject] = "nobody listens"
            # A publish outside its subjects is dropped; one on them, sent after it, shows it would have come.
            await grader.subscribe("payments.>", cb=note)
            await grader.subscribe("orders.>", cb=note)
            await grader.flush()
            await learner.publish("payments.charge", b"{}")
            await learner.publish("orders.placed", b"{}")
            await learner.flush()
            async with asyncio.timeout(5):
                while "orders.placed" not in heard:
                    await grader.flush()
            out["published"] = ", ".join(s for s in heard if s.split(".")[0] in ("payments", "orders"))
        finally:
            await learner.close()
            await grader.close()
        return out

    with EmbeddedServer(config=str(config)) as server:
        out = asyncio.run(body(server.url))
    assert out == {
        "loyalty.award": "answered",  # the learner may ask loyalty...
        "inventory.reserve": "nobody listens",  # ... but its subscription to the inventory's subject was refused
        "email.send": "answered",
        "published": "orders.placed",  # payments.charge is none of lab 01's subjects
    }


def test_the_playground_takes_the_email_provider_down_and_up(no_nats_url: None) -> None:
    import asyncio

    import msglab

    async def outage() -> None:
        env, _ = await msglab.playground("01")
        try:
            await env.set_service("email_provider", "down")
            with pytest.raises(ConnectionError, match="no email went out for o-1"):
                env.send_email("o-1")
            await env.set_service("email_provider", "up")
            env.send_email("o-1")  # sent: it prints, and raises nothing
        finally:
            await msglab.playground_close(env)

    asyncio.run(outage())
