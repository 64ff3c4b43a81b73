"""Lesson 05's experiments on a real server, with worker processes: counts and states only, no timing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from msglab.demos import backpressure as bp


def run(experiment: Callable[[bp.Shop], Awaitable[Any]]) -> Any:
    """Open the lesson's shop (one worker process, 20 ms an order), run one experiment, close it."""

    async def main() -> Any:
        shop = await bp.Shop.open()
        try:
            await shop.workers(1, work=0.02)
            return await experiment(shop)
        finally:
            await shop.close()

    return asyncio.run(main())


def test_a_flood_grows_the_queue_and_nobody_is_told(no_nats_url: None) -> None:
    flood = run(lambda shop: shop.overload(rate=150, seconds=1.0))
    assert flood.published > 0 and flood.refused == 0 and flood.errors == 0
    assert flood.depth[-1] > 0 and flood.age[-1] > 0
    assert len(flood.depth) == len(flood.age) == len(flood.main.t) > 2


def test_the_same_import_drains_at_two_speeds(no_nats_url: None) -> None:
    same = run(lambda shop: shop.same_depth(orders=200, seconds=0.5))
    quick, slow = same.series
    assert quick.depth[0] == slow.depth[0] == 200
    # Most of the slow import still waits: how much its one worker did depends on how long the quick
    # queue took, which a loaded machine stretches (at a load average of 20 it finished 15).
    assert quick.depth[-1] == 0 and slow.depth[-1] > 150
    # Sampled until the slow queue's age is past the quick one's highest, however slow the machine.
    assert 0 < same.marks["workers start"] < quick.t[-1] and max(quick.age) < slow.age[-1]


def test_an_admission_check_refuses_and_names_the_last_order_it_accepted(no_nats_url: None) -> None:
    admitted = run(lambda shop: shop.overload(rate=150, seconds=1.5, budget=0.3))
    assert admitted.refused > 0 and admitted.published > 0
    assert admitted.last_accepted_wait is not None and admitted.last_accepted_wait > 0
    assert admitted.arrival_rate > admitted.drain_rate > 0 and admitted.k > 1


def test_a_bounded_stream_deletes_old_orders_unless_told_to_refuse_new_ones(no_nats_url: None) -> None:
    async def experiment(shop: bp.Shop) -> Any:
        return await bp.discard_policies(shop.js, limit=3, orders=5, max_age=0.2)

    table = run(experiment)
    old, new, aged = table.rows
    assert old[1:] == [5, "0", "o-3, o-4, o-5"]  # every publish confirmed; the two oldest gone unread
    assert new[1:] == [3, f"2 ({bp.STREAM_FULL})", "o-1, o-2, o-3"]
    assert aged[1] == 5 and aged[3].startswith("none")


def test_one_stuck_order_keeps_the_queue_shallow_and_old_until_its_worker_is_killed(no_nats_url: None) -> None:
    stuck = run(lambda shop: shop.one_stuck(rate=10, hang=0.8))
    assert "SIGKILL" in stuck.marks
    assert max(stuck.depth) <= 3
    # Redelivered after the SIGKILL and done: the run samples until the oldest waiting order is young again
    # (a fresh one of the trickle may be waiting).
    assert max(stuck.age) > 0.5 and stuck.age[-1] < 0.1


def test_a_max_delivered_order_pins_the_ack_floor_until_the_next_ack(no_nats_url: None) -> None:
    pinned = run(lambda shop: shop.pinned_floor(wait=0.3))
    assert pinned["depth"] == 0 and pinned["age"] > 0
    assert pinned["depth after the next ack"] == 0 and pinned["age after"] == 0


def test_max_ack_pending_bounds_the_orders_in_flight(no_nats_url: None) -> None:
    async def experiment(shop: bp.Shop) -> tuple[dict[int, float], dict[str, float], dict[str, float]]:
        rates = await shop.scale_out([1, 4], slots=4, work=0.05, window=0.3)
        free = await shop.in_flight(8, max_ack_pending=None, slots=4, work=0.05, seconds=0.3)
        bound = await shop.in_flight(8, max_ack_pending=4, slots=4, work=0.05, seconds=0.3)
        await shop.reset()
        assert (await shop.measure())[0] == 0  # the rest of the backlog is gone
        return rates, free, bound

    rates, free, bound = run(experiment)
    assert set(rates) == {1, 4} and all(r > 0 for r in rates.values())
    assert bound["most in flight"] <= 4 < free["most in flight"]


def test_a_full_work_queue_stream_refuses_what_does_not_fit(no_nats_url: None) -> None:
    from nats.js.errors import APIError

    async def experiment(shop: bp.Shop) -> list[str]:
        await bp.bounded_intake(shop.js, limit=5)
        answers = []
        for i in range(7):
            try:
                await shop.js.publish("lesson05intake.orders", f"o-{i}".encode())
                answers.append("accepted")
            except APIError as exc:
                answers.append(f"refused {exc.err_code}")
        return answers

    assert run(experiment) == ["accepted"] * 5 + [f"refused {bp.STREAM_FULL}"] * 2


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        ([(0.0, 0.0), (0.2, 0.0)], "OK"),
        ([(0.0, 0.1), (0.2, 0.3)], "WARNING"),  # the age grows as fast as the clock
        ([(0.0, 0.1), (0.2, 0.15)], "OK"),  # a quarter as fast
        ([(0.0, 0.9), (0.2, 0.5)], "ERROR"),  # at the budget, falling or not
        ([(0.0, 0.3)], "OK"),
    ],
)
def test_status_comes_from_the_level_then_the_trend(window: list[tuple[float, float]], expected: str) -> None:
    assert bp.status(window, budget=0.5) == expected


def test_statuses_and_the_chart_follow_a_series() -> None:
    s = bp.Series("q")
    for i, age in enumerate([0.0, 0.04, 0.2, 0.35, 0.6, 0.8]):
        s.add(i * 0.1, 1, age)
    assert s.statuses(0.5, 0.25) == ["OK", "OK", "WARNING", "WARNING", "ERROR", "ERROR"]
    assert (s.first("WARNING", 0.5, 0.25), s.first("ERROR", 0.5, 0.25)) == (pytest.approx(0.2), pytest.approx(0.4))
    fig = bp.status_chart([("q", s)], budget=0.5, window=0.25)
    assert fig.axes[0].get_title() == "q"


def test_close_removes_the_lesson_streams(no_nats_url: None) -> None:
    from nats.js.errors import NotFoundError

    from msglab.broker import connect

    async def main() -> None:
        shop = await bp.Shop.open()
        await bp.bounded_intake(shop.js, limit=5)
        await shop.workers(1)
        pid = shop.pool.pid if shop.pool else 0
        await shop.close()
        nc = await connect()
        try:
            for name in bp.STREAMS:
                with pytest.raises(NotFoundError):
                    await nc.jetstream().stream_info(name)
        finally:
            await nc.close()
        with pytest.raises(ProcessLookupError):
            import os

            os.kill(pid, 0)

    asyncio.run(main())
