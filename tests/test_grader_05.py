"""Lab 05's grader judged on real runs: the starter fails with messages that teach, refusing by depth
is caught on the deep young queue, the plan replays from its seed, and the true-age bounds and the
status rule are right on their own. (What each variant's verdict must say is its `Says:` lines,
graded in tests/test_variants.py.)"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from msglab.graders.backpressure import BUDGET, NEEDLESS_MIN, Plan, Truth, status_cases
from msglab.grading.grade import grade
from msglab.world.fulfilment import Handled, Sample
from msglab.world.fulfilment import status as expected_status

VARIANTS = Path(__file__).parent / "variants" / "05_backpressure"
ALL = {
    "age_tracks_truth",
    "not_fooled_by_depth",
    "status_from_level_and_trend",
    "refuses_over_budget",
    "refuses_only_over_budget",
    "promise_kept",
    "busy_when_stream_full",
    "no_accepted_order_lost",
    "stored_once",
    "effects_on_the_workload",
    "faults_fired",
    "no_unplanned_deaths",
}
# Answers about orders nobody placed, reported on an intake's first call: nine, as many as the planned kill counts.
DECOYS = """

_place_order = place_order


async def place_order(env, order):
    if not getattr(env, "decoyed", False):
        env.decoyed = True
        for n in range(9):
            env.world.call("accepted", f"no-such-{n}")
    return await _place_order(env, order)
"""


def failure(verdict: Any, name: str) -> Any:
    return next(c for c in verdict.failures if c.name == name)


def test_starter_fails_with_the_silent_queue_story(no_nats_url: None) -> None:
    verdict = grade("05", seed=2)
    failed = {c.name for c in verdict.failures}
    # Its background publisher dies on the stream's first refusal, so the orders it accepted after that are never
    # stored: the grader starts no silence while an accepted order may still be published (rule 1 says so, and
    # stored_once could not be tested), on every run rather than when a late publish happened to miss it.
    must = ALL - {"refuses_only_over_budget", "no_unplanned_deaths", "effects_on_the_workload"}
    assert failed == must, verdict.to_text()
    assert "still not in the stream" in failure(verdict, "faults_fired").message, verdict.to_text()
    assert "always said 0" in failure(verdict, "age_tracks_truth").hint
    fooled = failure(verdict, "not_fooled_by_depth").message
    assert "Deep but fast" in fooled and "Shallow but stuck" in fooled
    assert "never refused anything" in failure(verdict, "refuses_over_budget").hint
    lost = failure(verdict, "no_accepted_order_lost")
    assert "SIGKILLed right after that answer" in lost.message and "memory" in lost.hint
    assert all(c.message and c.hint for c in verdict.failures)


def test_refusing_by_depth_breaks_the_promise_in_the_rush(no_nats_url: None) -> None:
    verdict = grade("05", source=VARIANTS / "refuses_by_depth.py", seed=4)
    check = failure(verdict, "promise_kept")
    assert "during the rush waited longer than the budget" in check.message, verdict.to_text()
    assert "depth / drain rate" in check.hint
    assert not {"age_tracks_truth", "not_fooled_by_depth", "status_from_level_and_trend"} & {
        c.name for c in verdict.failures
    }


def test_a_lost_confirmation_is_settled_by_a_retry_the_stream_recognises(no_nats_url: None) -> None:
    # Both faults fired (rule 1), and each wrong way to meet them fails for its own reason on the same seed.
    solved = grade("05", seed=9, source=Path(__file__).parents[1] / "solutions" / "05_backpressure" / "intake.py")
    assert solved.passed, solved.to_text()
    twice = failure(grade("05", source=VARIANTS / "retry_without_id.py", seed=9), "stored_once")
    assert "2 copies" in twice.message and "Nats-Msg-Id" in twice.hint
    told_busy = failure(grade("05", source=VARIANTS / "busy_on_timeout.py", seed=9), "stored_once")
    assert "answered BUSY, but the stream holds it" in told_busy.message


def test_a_lost_confirmation_meets_an_intake_that_refuses_for_a_while_first(no_nats_url: None) -> None:
    # A cool-down refuses every order for 0.4 s after the age falls back: a fault planned on an order named beforehand
    # met a refusal on a fast machine and a publish on a slow one (stored_once "could not be tested" in 2 gradings of 4,
    # seed 167). Landing on the first publish in the silence, both faults fire and the retry is judged every time.
    verdict = grade("05", source=VARIANTS / "lingering_busy.py", seed=167)
    assert {c.name for c in verdict.failures} == {"refuses_only_over_budget"}, verdict.to_text()


def test_a_monitor_counting_the_stream_s_first_message_is_caught_on_the_deep_young_queue(no_nats_url: None) -> None:
    # The first cancellation is clearly over the budget's age before the import lands, so the status such a monitor
    # gives the deep young queue is ERROR on every run (it was OK or ERROR by when the samples landed, seed 58).
    verdict = grade("05", source=VARIANTS / "age_of_stream_first.py", seed=58)
    fooled = failure(verdict, "not_fooled_by_depth")
    assert "Deep but fast" in fooled.message and "age_tracks_truth" in fooled.hint, verdict.to_text()
    # Its intake, measuring that age, refuses every order: refusals that prove nothing earn nothing (they passed
    # refuses_over_budget when one met phase 1's queue late on a slow machine: seed 57, 1 grading in 2).
    assert "refused every order" in failure(verdict, "refuses_over_budget").message, verdict.to_text()


def test_an_age_read_from_a_cancellation_refuses_the_calm_step_on_every_run(no_nats_url: None) -> None:
    # The calm step starts once a cancellation stored after the last ack is well over the budget's age: such an intake
    # refuses every order placed on the empty queue, so intake A never reaches its kill (rule 1 says it accepted none)
    # and its refusals prove nothing. Whether it accepted an order elsewhere came and went with the machine's pace
    # (refuses_over_budget flipped beside a busy loop, seed 1).
    verdict = grade("05", source=VARIANTS / "age_without_subject.py", seed=1)
    assert "made only 0 ACCEPTED answers" in failure(verdict, "faults_fired").message, verdict.to_text()
    assert "each on an empty queue" in failure(verdict, "refuses_over_budget").message, verdict.to_text()


def test_refusing_while_anything_is_unfinished_is_needless_clearly_while_the_workers_keep_up(no_nats_url: None) -> None:
    # Keeping up: a few of the shop's orders always in hand, none waiting long. Each customer there is refused by an
    # intake that refuses while anything is unfinished: far more needless refusals than the check needs (the rush's
    # start alone gave about six, near the five judged, and fewer on a loaded machine).
    verdict = grade("05", source=VARIANTS / "refuses_early.py", seed=7)
    check = failure(verdict, "refuses_only_over_budget")
    assert int(check.message.split(" of ")[0]) >= 2 * NEEDLESS_MIN, verdict.to_text()
    assert not {"faults_fired", "refuses_over_budget"} & {c.name for c in verdict.failures}, verdict.to_text()


def test_the_lessons_admission_check_breaks_the_promise_and_says_why(no_nats_url: None) -> None:
    # Lesson 05's own cells (BUSY only once the age is over the budget): the orders accepted while the age was still
    # under it wait about k times the budget; a forecast (the solution) keeps the promise on the same seed.
    copied = grade("05", source=VARIANTS / "from_lesson.py", seed=7)
    assert {c.name for c in copied.failures} == {"promise_kept", "stored_once"}, copied.to_text()
    check = failure(copied, "promise_kept")
    assert "the age was under the budget when you accepted it" in check.hint and "Little's law" in check.hint
    assert grade("05", seed=7, source=Path(__file__).parents[1] / "solutions" / "05_backpressure" / "intake.py").passed


def test_a_silence_meets_the_publish_of_an_outbox_not_its_backlog(no_nats_url: None) -> None:
    # The stream falls silent only once it holds every order accepted so far, and the order answered ACCEPTED in the
    # silence is waited for: the background task's next publish is that order's, refused without a word. Begun while
    # the outbox still published earlier orders, the silence met one of them or not by the machine's pace (stored_once
    # failed in 1 of 8 pairs beside a busy loop).
    from msglab.grading.nemesis import plan_seed

    seed = next(s for s in range(1, 40) if Plan.draw(plan_seed(s)).lost[0] == "request")  # the refusal comes first
    verdict = grade("05", source=VARIANTS / "outbox_in_memory.py", seed=seed)
    check = failure(verdict, "stored_once")
    assert "answered ACCEPTED, but the stream never stored it" in check.message, verdict.to_text()


def test_answers_about_orders_nobody_placed_do_not_take_the_kill(no_nats_url: None, tmp_path: Path) -> None:
    # An intake that accepts into memory, after nine decoy answers: on a grader that counted every answer, intake A
    # was killed among its decoys, holding nothing. The kill lands right after a real ACCEPTED: that order is lost.
    decoyed = tmp_path / "intake.py"
    decoyed.write_text((VARIANTS / "outbox_in_memory.py").read_text() + DECOYS)
    verdict = grade("05", source=decoyed, seed=3)
    assert "planned to kill" not in verdict.to_text(), verdict.to_text()  # the kill fired (rule 1 has no word on it)
    lost = failure(verdict, "no_accepted_order_lost")
    assert "SIGKILLed right after that answer" in lost.message, verdict.to_text()
    decoys = failure(verdict, "effects_on_the_workload")
    assert "called accepted for no-such-0" in decoys.message and "nobody placed" in decoys.hint


def test_plan_replays_from_its_seed() -> None:
    for seed in range(1, 40):
        plan = Plan.draw(seed)
        assert plan == Plan.draw(seed)
        assert 200 <= plan.burst <= 300 and 4 <= plan.kill_at <= 9 and 2 <= plan.refused <= 4
        assert sorted(plan.lost) == ["reply", "request"]  # both lost confirmations on every seed, in either order
    assert len({Plan.draw(seed) for seed in range(1, 40)}) > 10
    assert len({Plan.draw(seed).lost for seed in range(1, 40)}) == 2


def test_the_kill_after_an_acceptance_is_worded_for_rule_1() -> None:
    crashes = {Plan(250, k, 3, (0.5,)).crash() for k in (4, 1, 2, 3, 11, 22)}
    assert {(c.effect, c.when, c.counted) for c in crashes} == {("accepted", "after", "ACCEPTED answer")}
    points = sorted(c.point.split("the ")[1] for c in crashes)
    assert points == ["11th time", "1st time", "22nd time", "2nd time", "3rd time", "4th time"]
    assert all("under the budget" in c.hint for c in crashes)


def test_the_lesson_and_the_grader_share_one_fulfilment_model() -> None:
    from msglab.demos import backpressure as demo
    from msglab.graders import backpressure as grader
    from msglab.world import fulfilment

    assert demo.status is grader.expected_status is fulfilment.status
    assert demo.depth_and_age is grader.depth_and_age is fulfilment.depth_and_age
    assert grader.Fulfilment is fulfilment.Fulfilment


def test_the_status_windows_agree_with_the_rule() -> None:
    for _, samples, budget, expected in status_cases(Plan.draw(1)):
        assert expected_status(samples, budget) == expected
    # Depth plays no part: the same ages, any depth, the same status.
    ages = [Sample(0.0, 0.1, 1), Sample(0.1, 0.2, 1)]
    deep = [Sample(t, a, 10_000) for t, a, _ in ages]
    assert expected_status(ages, BUDGET) == expected_status(deep, BUDGET) == "WARNING"


def test_true_age_bounds_cover_every_moment_of_a_call() -> None:
    # Order 1 stored at 10.0, its ack sent at 12.0 and confirmed at 12.1; order 2 stored at 11.0, never acked.
    truth = Truth([Handled(1, 10.0, "o-1", 12.0, 12.1), Handled(2, 11.0, "o-2")])
    assert truth.bounds(10.5, 10.6)[:2] == pytest.approx((0.5, 0.6))  # only order 1 waits
    lb, ub, oldest = truth.bounds(11.9, 12.2)  # the ack lands during the call: order 1 or order 2 is the oldest
    assert (lb, ub) == pytest.approx((0.9, 2.2)) and oldest is not None and oldest.order_id == "o-1"
    assert truth.bounds(13.0, 13.0)[:2] == pytest.approx((2.0, 2.0))  # order 2 alone
    assert truth.bounds(9.0, 9.5)[:2] == (0.0, 0.0)  # nothing stored yet
    assert math.isinf(Handled(3, 0.0, None).ack_done)


async def until(condition: Any, limit: float = 10.0) -> bool:
    """Poll an async condition until it holds (True) or `limit` seconds pass (False)."""
    deadline = asyncio.get_running_loop().time() + limit
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def over_budget(env: Any, lab: Any) -> bool:
    return bool(await lab.queue_age(env) > env.age_budget)


async def drained(env: Any, lab: Any) -> bool:
    return bool(await lab.queue_depth(env) == 0)


def test_playground_lets_a_learner_stall_the_workers_by_hand(no_nats_url: None) -> None:
    import msglab

    async def by_hand(solution: bool) -> list[str]:
        env, lab = await msglab.playground("05", solution=solution)
        try:
            await env.workers.stall()
            answers = [await lab.place_order(env, {"id": f"o-{i}", "sku": "s", "qty": 1}) for i in range(3)]
            assert await until(lambda: over_budget(env, lab))  # the workers are stalled: the age only grows
            answers.append(await lab.place_order(env, {"id": "o-late", "sku": "s", "qty": 1}))
            env.workers.scale(4)
            assert await until(lambda: drained(env, lab))
            answers.append(await lab.place_order(env, {"id": "o-again", "sku": "s", "qty": 1}))
            raw = await env.js.get_last_msg(env.stream("ORDERS"), env.subject("orders.placed"))
            assert json.loads(raw.data)["id"] == "o-again"
            return answers
        finally:
            await env.workers.close()
            await msglab.playground_close(env)

    # The first order meets an empty queue; with every worker stalled nothing is being finished, so the solution's
    # forecast refuses the next ones (a learner comparing the age alone accepts them: both are the learner's call);
    # over the budget everyone refuses, and once drained everyone accepts.
    answers = asyncio.run(by_hand(solution=True))
    assert answers[0] == "accepted" and answers[3:] == ["busy", "accepted"], answers


def test_the_learner_may_publish_orders_and_read_the_queue_and_nothing_more(no_nats_url: None, tmp_path: Path) -> None:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import LEARNER_INBOX, RunUsers
    from msglab.graders import backpressure
    from msglab.grading.labkit import Names

    async def attempt(coro: Any) -> str:
        try:
            await asyncio.wait_for(coro, 1.5)
        except Exception as exc:  # a permission violation shows as no answer (a timeout) or an API error
            return f"refused ({type(exc).__name__})"
        return "ok"

    async def operations(grader_url: str, learner_url: str) -> dict[str, str]:
        grader = await nats.connect(grader_url)
        await backpressure.TOPOLOGY.provision(grader.jetstream(), Names())
        learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX, allow_reconnect=False)
        js = learner.jetstream()
        order = json.dumps({"id": "o-1"}).encode()
        fulfil = ConsumerConfig(durable_name="fulfil", filter_subject="orders.>", ack_policy=AckPolicy.NONE)
        out = {
            "publish an order": await attempt(js.publish("orders.placed", order)),
            "consumer info": await attempt(js.consumer_info("ORDERS", "fulfil")),
            "the first order after the ack floor": await attempt(
                js.get_msg("ORDERS", 1, subject="orders.placed", next=True)
            ),
            "stream info": await attempt(js.stream_info("ORDERS")),
            "publish a cancellation": await attempt(js.publish("orders.cancelled", b"{}")),
            "publish elsewhere": await attempt(js.publish("shipping.done", b"{}")),
            "update the durable": await attempt(js.add_consumer("ORDERS", fulfil)),
            "purge the stream": await attempt(js.purge_stream("ORDERS")),
        }
        await learner.close()
        await grader.close()
        return out

    users = RunUsers(grader=backpressure)
    config = tmp_path / "server.conf"
    config.write_text(users.config())
    with EmbeddedServer(config=str(config)) as server:
        out = asyncio.run(operations(users.grader_url(server.url), users.learner_url(server.url)))
    allowed = {"publish an order", "consumer info", "the first order after the ack floor", "stream info"}
    assert {k for k, v in out.items() if v == "ok"} == allowed, out
