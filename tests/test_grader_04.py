"""Lab 04's grader judged on real runs: the starter fails with the hot-loop story, the plan replays
from the seed, every planned fault really happens, and the playground works by hand. (What each
variant's verdict must say is its `Says:` lines, graded in tests/test_variants.py.)"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from msglab.graders import poison_messages as grader
from msglab.graders.poison_messages import PERMANENT, draw_plan
from msglab.grading.grade import grade

VARIANTS = Path(__file__).parent / "variants" / "04_poison_messages"


def test_starter_fails_with_the_hot_loop_story(no_nats_url: None) -> None:
    verdict = grade("04", seed=2)
    failed = {c.name for c in verdict.failures}
    assert {"none_lost", "permanent_not_retried", "retries_bounded", "transient_delivered"} <= failed, verdict.to_text()
    assert all(c.message and c.hint for c in verdict.failures)
    lost = next(c for c in verdict.failures if c.name == "none_lost")
    assert "max_deliver moves a message nowhere" in lost.message
    hot = next(c for c in verdict.failures if c.name == "retries_bounded")
    assert "nak'ed with no delay" in hot.message and any("nak'ed (delivery 1), no delay" in s for s in hot.trace)


def test_plan_replays_from_its_seed_and_meets_every_kind() -> None:
    for seed in range(1, 40):
        plan = draw_plan(seed)
        assert plan == draw_plan(seed)
        kinds = [e.kind for e in plan.emails]
        assert sorted(kinds) == sorted(["ok"] * 3 + ["flaky"] * 2 + list(PERMANENT) + ["unreachable"] + ["outage"] * 4)
        assert sum(e.kind in PERMANENT for e in plan.phase(1)[:4]) == 2  # worker #1 meets its faults early
        assert {plan.get(o).kind for o in plan.redrive} == {"template", "unreachable"}
        assert all(1 <= len(e.script) <= 2 for e in plan.emails if e.kind == "flaky")
        # Every seed meets every transient answer (503 comes with the outage): a 429, a 502 and a reset.
        assert {"429", "502", "reset"} <= {a for e in plan.emails for a in e.script}
        malformed = next(e for e in plan.emails if e.kind == "malformed")
        with pytest.raises(ValueError):
            json.loads(malformed.payload)
    assert draw_plan(1) != draw_plan(2)


def test_every_planned_fault_happens_in_a_solution_run(no_nats_url: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    collect = grader.Evidence.collect.__func__  # type: ignore[attr-defined]

    async def spy(cls: Any, lab: Any) -> Any:
        seen["ev"] = await collect(cls, lab)
        return seen["ev"]

    monkeypatch.setattr(grader.Evidence, "collect", classmethod(spy))
    verdict = grade("04", solution=True, seed=9)
    assert verdict.passed, verdict.to_text()
    ev = seen["ev"]
    lab = ev.lab
    first = lab.workers[0]
    refused = [p for p in lab.publishes if p.name == "dlq_refused" and p.pid == first.pid]
    assert len(refused) == 1  # the DLQ stream refused worker #1's first dead letter, and only that one
    assert lab.refused in lab.run.planned and lab.refused.fired  # rule 1 holds the run to the refusal
    # The transfer: the unreachable email's first dead letter, on its last delivery, was refused too, and the
    # solution kept the email until the DLQ stream had it.
    assert lab.last_refused in lab.run.planned and lab.last_refused.fired
    unreachable = next(e.order for e in ev.plan.emails if e.kind == "unreachable")
    life = ev.life(unreachable)
    refused_last = [p for p in life.publishes if p.name == "dlq_refused"]
    assert [life.delivery_at(p.pid, p.ts) for p in refused_last] == [grader.MAX_DELIVER]
    assert [entry.headers.get("Dlq-Deliveries") for entry in life.dlq] == [str(grader.MAX_DELIVER)]
    assert lab.workers[0].fired and lab.redrivers[0].fired  # both kills
    # Rule 2: the worker asked again after an empty fetch, then sent the late email itself.
    assert lab.refetch is not None and lab.sent_by(ev.plan.late.order) == [lab.workers[1].pid]
    assert ev.plan.late.order not in {m.email.order for m in lab.msgs.values()}  # no other check judges it
    assert any(p.name == "dlq_published" and p.detail.get("duplicate") for p in lab.publishes)  # the copy, dropped
    dead = {e.order for e in ev.plan.emails if e.kind in grader.DEAD}
    assert sorted(entry.msg.email.order for entry in ev.dlq if not entry.msg.copy_run) == sorted(dead)
    assert [number for number, *_ in lab.redrive_runs] == [1, 2, 3]


def test_the_graders_own_lateness_is_not_counted_as_the_workers(
    no_nats_url: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The grader's loop stalls for longer than QUEUE_AGE_HARD right after the first ordinary email of step 2
    # (as a loaded machine's other graders, holding the GIL, once made it): every stamp it makes then comes
    # late. A correct worker still keeps the line moving; a worker that retries inside one delivery still fails.
    publish = grader.Lab.publish
    stall = grader.QUEUE_AGE_HARD + 0.5

    async def stalled(lab: grader.Lab, email: grader.Email, judged: bool = True) -> grader.Msg:
        msg = await publish(lab, email, judged)
        if email.kind == "outage" and email.offset == grader.FOLLOWERS[0]:
            time.sleep(stall)  # noqa: ASYNC251 (blocking the grader's loop is the stall under test)
        return msg

    monkeypatch.setattr(grader.Lab, "publish", stalled)
    right = grade("04", source=VARIANTS / "also_right" / "budget_from_consumer.py", seed=11)
    assert right.passed, right.to_text()
    wrong = grade("04", source=VARIANTS / "sleeps_in_handler.py", seed=11)
    line = next((c for c in wrong.failures if c.name == "line_keeps_moving"), None)
    assert line is not None and "within one delivery" in line.message, wrong.to_text()


def test_playground_lets_a_learner_try_one_poison_email(no_nats_url: None) -> None:
    import msglab

    async def by_hand(solution: bool) -> tuple[int, list[str]]:
        env, lab = await msglab.playground("04", solution=solution)
        try:
            payload = json.dumps({"order_id": "o-1", "to": "anna@gmial.con", "template": "order_confirmation"})
            await env.js.publish(env.subject("orders.email"), payload.encode(), headers={"Order-Id": "o-1"})
            sub = await env.js.pull_subscribe_bind(env.durable("email"), env.stream("EMAILS"))
            msg = (await sub.fetch(1, timeout=2))[0]
            await lab.handle(env, msg)
            dlq = env.stream("EMAILS_DLQ")
            count = (await env.js.stream_info(dlq)).state.messages
            reasons = [(await env.js.get_msg(dlq, seq)).headers.get("Dlq-Reason", "") for seq in range(1, count + 1)]
            return count, reasons
        finally:
            await env.provider.stop()
            await msglab.playground_close(env)

    assert asyncio.run(by_hand(solution=False)) == (0, [])
    count, reasons = asyncio.run(by_hand(solution=True))
    assert count == 1 and "422" in reasons[0]
