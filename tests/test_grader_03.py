"""Lab 03's grader judged on real runs, by behaviour: the starter fails with the incident's own story,
a redelivery after the gateway's key window is caught and survivable, the race of two workers is
decided only by the learner's uniqueness guarantee, and every claim a message makes is true of the
evidence the grader collected. (tests/test_variants.py grades every variant on four seeds and checks
the words of its verdict, its `Says:` lines; this file grades a variant only to compare what its
verdict claims with the grader's evidence.)"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from msglab.graders import idempotency
from msglab.graders.idempotency import ACK_WAIT, KEY_WINDOW, POINTS, draw_plan
from msglab.grading.grade import grade
from msglab.grading.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = Path(__file__).parent / "variants" / "03_idempotency"
SOLUTION = ROOT / "solutions" / "03_idempotency" / "payments.py"
CHECKS = {
    "charged_once",
    "none_lost",
    "credited_once",
    "stable_key",
    "all_acked",
    "survives_idle",
    "effects_on_the_workload",
}


@pytest.fixture
def evidence(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """What the grader collected in the run a test makes (the evidence its checks judged)."""
    seen: dict[str, Any] = {}
    collect = idempotency._Evidence.collect.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, *args: Any) -> Any:
        seen["ev"] = collect(cls, *args)
        return seen["ev"]

    monkeypatch.setattr(idempotency._Evidence, "collect", classmethod(spy))
    yield seen


def failure(verdict: Verdict, name: str) -> Any:
    found = [c for c in verdict.failures if c.name == name]
    assert found, f"{name} did not fail:\n{verdict.to_text()}"
    return found[0]


def test_solution_passes_and_every_planned_event_happened(no_nats_url: None, evidence: dict[str, Any]) -> None:
    verdict = grade("03", solution=True, seed=9)
    assert verdict.passed, verdict.to_text()
    assert CHECKS | {"faults_fired", "no_unplanned_deaths"} == {c.name for c in verdict.checks}
    ev = evidence["ev"]
    for point, pid in ev.plan.crashed:  # at least once: under load a redelivery can meet a second crash point
        assert sum("(SIGKILL, injected)" in step for step in ev.traces[pid]) >= 1, (point, ev.traces[pid])
    race = ev.traces[ev.plan.race]
    assert sum("held there until a second worker" in step for step in race) == 2
    assert any("both workers let go at once" in step for step in race)
    assert any("a day later" in step for step in ev.traces[ev.plan.day_later])
    assert ev.lab.advanced_at is not None
    # The key window is survivable with the gateway's search: the payment redelivered after it was
    # charged once, and found by a search after the clock moved.
    expired = dict(ev.plan.crashed)["key_expired"]
    (charge,) = ev.charges[expired]
    steps = ev.traces[expired]
    moved = next(i for i, s in enumerate(steps) if "clock moved 25 h" in s)
    assert any(f"searched the gateway for charges of it: {charge.charge_id}" in s for s in steps[moved:]), steps
    # and a payment credited earlier never reaches the gateway again when its copy comes a day later
    assert len(ev.requests[ev.plan.day_later]) == 1
    # A payment charged by a killed worker, its message removed, comes back as a new message after the
    # window: the copy's worker found the charge by the search and credited it, without charging again.
    resent = ev.plan.copy_later
    (charge,) = ev.charges[resent]
    (copy,) = [p for p in ev.lab.published if p.payment_id == resent and p.label == "resent"]
    assert copy.ts > ev.lab.advanced_at and ev.lab.removed == {s for s in ev.seqs(resent) if s != copy.seq}
    assert ev.ledger[resent] == 1 and len(ev.requests[resent]) == 1
    assert any(f"searched the gateway for charges of it: {charge.charge_id}" in s for s in ev.traces[resent])


def test_starter_fails_with_the_double_charge_story(no_nats_url: None) -> None:
    verdict = grade("03", seed=3)
    assert {"charged_once", "credited_once", "stable_key"} <= {c.name for c in verdict.failures}
    assert all(c.message and c.hint for c in verdict.failures), verdict.to_text()
    charged = failure(verdict, "charged_once")
    # The incident leads: the payment whose worker died right after the gateway charged it.
    assert "killed right after the gateway charged it" in charged.message
    assert "different keys" in charged.message and "from the payment itself" in charged.hint
    assert any("(SIGKILL, injected)" in step for step in charged.trace)
    credited = failure(verdict, "credited_once")
    assert "killed right after committing the credit" in credited.message  # the simplest story first


def test_a_redelivery_after_the_key_window_is_caught_and_named(no_nats_url: None, evidence: dict[str, Any]) -> None:
    # A stable key and a dedup check in front of the gateway, but nothing for the key window.
    verdict = grade("03", source=VARIANTS / "key_window_trusted.py", seed=2)
    assert [c.name for c in verdict.failures] == ["charged_once"], verdict.to_text()
    charged = verdict.failures[0]
    ev = evidence["ev"]
    expired = dict(ev.plan.crashed)["key_expired"]
    assert charged.message.split(":")[1].strip().startswith(expired)  # its words: the variant's Says lines
    first, second = ev.charges[expired]
    assert second.created - first.created > KEY_WINDOW  # on the gateway's own clock
    assert {r.idempotency_key for r in ev.requests[expired]} == {expired}  # one key all along
    steps = ev.traces[expired]
    moved = next(i for i, s in enumerate(steps) if "clock moved 25 h" in s)
    killed = next(i for i, s in enumerate(steps) if "killed after the gateway charged it" in s)
    assert killed < moved < max(i for i, s in enumerate(steps) if "asked the gateway to charge it" in s)


def test_a_copy_after_the_key_window_must_be_searched_like_a_redelivery(
    no_nats_url: None, evidence: dict[str, Any]
) -> None:
    # The search asked only on a redelivery: every redelivery is safe, the checkout's copy is not.
    verdict = grade("03", source=VARIANTS / "search_only_redelivered.py", seed=5)
    assert [c.name for c in verdict.failures] == ["charged_once"], verdict.to_text()
    ev = evidence["ev"]
    resent = ev.plan.copy_later
    assert f"more than once: {resent} was charged 2 times" in verdict.failures[0].message
    first, second = ev.charges[resent]
    assert second.created - first.created > KEY_WINDOW  # on the gateway's own clock
    (copy,) = [p for p in ev.lab.published if p.payment_id == resent and p.label == "resent"]
    assert [a.delivered for a in ev.lab.watch.of(copy.seq) if a.kind == "ack"] == [1]  # a first delivery
    # its first message, removed after the kill, was delivered once and never again
    (removed,) = ev.lab.removed
    made = [r.split(".") for r in ev.lab.watch.deliveries]  # $JS.ACK.<stream>.<durable>.<delivered>.<sseq>...
    assert [int(t[4]) for t in made if len(t) == 9 and int(t[5]) == removed] == [1]


def test_the_race_is_decided_only_by_the_uniqueness_guarantee(no_nats_url: None, evidence: dict[str, Any]) -> None:
    verdict = grade("03", source=VARIANTS / "check_then_insert_no_unique.py", seed=6)
    assert [c.name for c in verdict.failures] == ["credited_once"], verdict.to_text()
    credited = verdict.failures[0]
    race = evidence["ev"].plan.race  # the run's own plan (drawn from the seed as the grader keys it)
    assert f": {race} (" in credited.message  # its words: the variant's Says lines
    assert sum("held there until a second worker" in step for step in credited.trace) == 2
    held = [int(w) for w in re.findall(r"worker (\d+) reached its first database write", "\n".join(credited.trace))]
    assert len(set(held)) == 2  # two processes, each held at its own first write
    assert evidence["ev"].ledger[race] == 2


def test_a_key_from_the_clock_fails_because_redeliveries_come_over_a_second_later(
    no_nats_url: None, evidence: dict[str, Any]
) -> None:
    verdict = grade("03", source=VARIANTS / "key_from_the_clock.py", seed=4)
    stable = failure(verdict, "stable_key")
    ev = evidence["ev"]
    pid = re.search(r"(p-\d\d) was sent", stable.message).group(1)  # type: ignore[union-attr]
    times = [r.ts for r in ev.requests[pid]]
    assert max(times) - min(times) >= 1.0  # rule 5: no luck in timing
    assert f"came {max(times) - min(times):.1f} s apart" in stable.message
    assert pid == dict(ev.plan.crashed)["after_charge"]


def test_what_failing_messages_claim_is_what_the_evidence_shows(no_nats_url: None, evidence: dict[str, Any]) -> None:
    for variant, seed in [("random_key_per_attempt", 7), ("dedup_outside_transaction", 8), ("stream_sequence_key", 1)]:
        verdict = grade("03", source=VARIANTS / f"{variant}.py", seed=seed)
        ev = evidence["ev"]
        published = {p.seq: p.payment_id for p in ev.lab.published}
        for check in verdict.failures:
            if check.name in ("faults_fired", "no_unplanned_deaths"):
                continue
            pid = re.search(r"\b(p-\d\d)\b", check.message).group(1)  # type: ignore[union-attr]
            made = {c.charge_id for c in ev.charges.get(pid, [])}
            for charge_id in re.findall(r"ch_[0-9a-f]{12}", check.message):
                assert charge_id in made, (variant, check.message)
            for seq in re.findall(r"stream seq (\d+)", check.message):
                assert published[int(seq)] == pid, (variant, check.message)
            count = re.search(rf"{pid} was charged (\d+) times", check.message)
            if count:
                assert int(count.group(1)) == len(made)
            if "killed" in check.message:
                assert pid in dict((p, q) for q, p in ev.plan.crashed), check.message
            if "in your ledger" in check.message and "no row" in check.message:
                assert ev.ledger.get(pid, 0) == 0


def test_a_worker_cannot_reach_the_gateway_behind_the_graders_back(
    no_nats_url: None, evidence: dict[str, Any], tmp_path: Path
) -> None:
    forger = tmp_path / "payments.py"
    forger.write_text(
        SOLUTION.read_text().replace(
            "    setup_db(env.db)\n",
            "    setup_db(env.db)\n"
            "    for subject, body in [('gateway.test_clock', {'seconds': -1e6}),\n"
            "                          ('gateway.charge', {'account': 'acct-1', 'cents': 1, 'reference': 'forged'})]:\n"
            "        try:\n"
            "            await env.nc.request(subject, json.dumps(body).encode(), timeout=0.3)\n"
            "        except Exception as exc:\n"
            "            print('refused:', type(exc).__name__)\n",
            1,
        )
    )
    verdict = grade("03", source=forger, seed=3)
    assert verdict.passed, verdict.to_text()  # the solution's work is untouched
    ev = evidence["ev"]
    assert "forged" not in ev.charges  # no charge reached the gateway's store
    first = min((r for rs in ev.requests.values() for r in rs), key=lambda r: r.ts)
    assert abs(first.at - first.ts) < 60  # and the gateway's clock was not moved before the grader moved it


def test_plan_replays_from_its_seed_and_covers_every_point() -> None:
    for seed in range(1, 30):
        plan = draw_plan(seed)
        assert plan == draw_plan(seed)
        assert [point for point, _ in plan.crashed] == list(POINTS)  # every kill point, every seed
        roles = [pid for _, pid in plan.crashed] + [plan.race, plan.late, *plan.plain]
        assert sorted(roles) == sorted(plan.ids)  # every payment has one role
        assert plan.day_later in plan.plain
        assert len({p["account"] for p in plan.payments}) == 3
    assert draw_plan(1) != draw_plan(2)
    assert ACK_WAIT > 1.0  # a redelivery comes more than a second after its delivery (rule 5)


def test_playground_lets_a_learner_see_a_redelivery_and_a_day_later_by_hand(no_nats_url: None) -> None:
    import msglab

    async def by_hand(solution: bool) -> tuple[int, int, int, int]:
        made, lab = await msglab.playground("03", solution=solution)
        env: Any = made  # the lab's grader added db, charge, find_charges and gateway to it
        try:
            lab.setup_db(env.db)
            payment = {"payment_id": "p-1", "account": "acct-1", "cents": 1250}
            await env.js.publish(env.subject("payments.received"), json.dumps(payment).encode())
            sub = await env.js.pull_subscribe_bind(env.durable("payments"), env.stream("PAYMENTS"))
            msg = (await sub.fetch(1, timeout=2))[0]
            await lab.handle_payment(env, msg)
            await lab.handle_payment(env, msg)  # the same message again, as a redelivery
            charges, rows = len(env.gateway.charges("p-1")), env.db.execute("select count(*) from ledger").fetchone()
            await env.gateway.advance(env.nc, hours=25)
            await lab.handle_payment(env, msg)  # and again, a day later
            await msg.ack_sync()
            later = env.db.execute("select count(*) from ledger").fetchone()[0]
            return charges, rows[0], len(env.gateway.charges("p-1")), later
        finally:
            env.db.close()
            await msglab.playground_close(env)

    assert asyncio.run(by_hand(solution=False)) == (2, 2, 3, 3)
    assert asyncio.run(by_hand(solution=True)) == (1, 1, 1, 1)


def test_the_learner_may_use_the_labs_subjects_and_durable_and_nothing_else(tmp_path: Path) -> None:
    import nats

    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import LEARNER_INBOX, RunUsers
    from msglab.grading.labkit import Names

    users = RunUsers(grader=idempotency)  # the permissions a grading run of lab 03 gives the learner
    config = tmp_path / "server.conf"
    config.write_text(users.config())

    async def attempts(grader_url: str, learner_url: str) -> tuple[list[str], list[str]]:
        grader = await nats.connect(grader_url)
        await idempotency.TOPOLOGY.provision(grader.jetstream(), Names())
        refused: list[str] = []

        async def on_error(exc: Exception) -> None:
            refused.append(str(exc))

        learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX, error_cb=on_error)
        js = learner.jetstream()
        done: list[str] = []
        ack = await js.publish("payments.received", b'{"payment_id": "p-01"}')  # the lab's own subject
        sub = await js.pull_subscribe_bind(idempotency.DURABLE, idempotency.STREAM)
        [msg] = await sub.fetch(1, timeout=2)
        await msg.ack_sync()
        done.append(f"fetched and acked seq {ack.seq}")
        await learner.subscribe("orders.>")  # another lab's subjects, and everything
        await learner.subscribe(">")
        await learner.publish("orders.placed", b"x")
        await learner.publish("gateway.test_clock", b'{"seconds": 1e6}')  # the course's gateway
        await learner.flush()
        for _ in range(200):  # the server's refusals arrive as asynchronous errors: wait for all four
            if len(refused) >= 4:
                break
            await learner.flush()
        await learner.close()
        await grader.close()
        return done, refused

    with EmbeddedServer(config=str(config)) as server:
        done, refused = asyncio.run(attempts(users.grader_url(server.url), users.learner_url(server.url)))
    assert done == ["fetched and acked seq 1"]
    said = "\n".join(refused).lower()
    for subject in ("orders.>", '">"', "orders.placed", "gateway.test_clock"):
        assert subject in said, refused


# The solution, with the shop's database swapped for a FIFO by its first worker: the grader's one read of a
# learner-writable path (the ledger, at the end) must neither block on it nor follow it.
FIFO_LEDGER = (
    SOLUTION.read_text()
    + """

_solved = payment_worker


async def payment_worker(env) -> None:
    import os

    try:
        os.rename(env.db_path, env.db_path + ".old")
        os.mkfifo(env.db_path)
    except OSError:
        pass  # another worker swapped it first
    await _solved(env)
"""
)


def test_a_fifo_in_place_of_the_ledger_fails_the_ledger_checks_without_waiting(
    no_nats_url: None, tmp_path: Path
) -> None:
    source = tmp_path / "payments.py"
    source.write_text(FIFO_LEDGER)
    verdict = grade("03", source=source, seed=4)
    failed = {c.name for c in verdict.failures}
    assert {"none_lost", "credited_once"} <= failed and "finishes" not in failed, verdict.to_text()
    lost = next(c for c in verdict.failures if c.name == "none_lost")
    assert "could not read your ledger table" in lost.message and "not a regular file" in lost.message, lost.message
