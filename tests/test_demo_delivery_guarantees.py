"""The lesson 02 crash experiment on a real server: the counts follow the seeded schedule, and
the timeline draws what the run recorded. Counts and states only, no timing."""

from __future__ import annotations

import asyncio
from typing import Any

from msglab.demos import delivery_guarantees as crashlab
from msglab.notebook import timeline


async def ack_first(env: Any, msg: Any) -> None:
    await msg.ack_sync()
    await env.charge(msg.data.decode())


async def ack_after(env: Any, msg: Any) -> None:
    await env.charge(msg.data.decode())
    await msg.ack_sync()


async def ack_buffered(env: Any, msg: Any) -> None:
    order_id = msg.data.decode()
    await env.charge(order_id)
    await msg.ack()
    env.done(order_id)


def test_each_ack_order_pays_for_its_own_kind_of_crash(no_nats_url: None) -> None:
    first = asyncio.run(crashlab.run(ack_first, messages=40, crashes=4, seed=3))
    after = asyncio.run(crashlab.run(ack_after, messages=40, crashes=4, seed=3))
    assert first.schedule == after.schedule  # the same seed, the same kills
    assert len(first.crashes) == len(after.crashes) == 4  # every planned kill fell on a message
    before = sum(point == "before" for point, _ in first.schedule)
    assert (first.lost, first.duplicated) == (before, 0)
    assert (after.lost, after.duplicated) == (0, 4 - before)
    lost = first.lost_orders[0] if first.lost_orders else None
    if lost:
        assert "SIGKILL before the charge" in first.story(lost)[-1]


def test_a_bare_ack_dies_with_the_process(no_nats_url: None) -> None:
    result = asyncio.run(crashlab.run(ack_buffered, messages=20, crashes=2, seed=5, points=("done",)))
    assert result.duplicated == 2 and result.lost == 0
    fig = timeline.draw(result)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels.count("kill 1") == 1 and labels.count("kill 2") == 1
