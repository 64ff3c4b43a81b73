"""Lesson 07's dual write on a real server: a checkout process SIGKILLed between its two writes, in real
processes. Commit-then-publish loses exactly the killed orders, publish-then-commit publishes exactly
them without an order, and the outbox with its relay (itself killed after acks) does neither. Counted
from the shop's database and the stream; no timing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from msglab.demos import pipeline

INSERT_ORDER = pipeline.INSERT_ORDER  # a lesson cell's own constant: shipped to the checkout process with its code


def test_each_dual_write_breaks_as_taught_and_the_outbox_breaks_neither_way(no_nats_url: None) -> None:
    async def body() -> list[pipeline.DualWrite]:
        return [
            await pipeline.dual_write("commit_then_publish", orders=30, kills=4, seed=1),
            await pipeline.dual_write("publish_then_commit", orders=30, kills=4, seed=1),
            await pipeline.dual_write("with_outbox", orders=30, kills=4, relay_kills=2, seed=1),
        ]

    commit_first, publish_first, outbox = asyncio.run(body())
    for result in (commit_first, publish_first, outbox):
        assert len(result.killed) == result.kills == 4  # every planned kill fired, each on its order
    assert commit_first.killed == publish_first.killed == outbox.killed  # the same seed, the same orders

    assert (commit_first.committed, commit_first.published) == (30, 26)
    assert commit_first.lost == commit_first.killed and commit_first.phantom == []  # orders nobody hears of

    assert (publish_first.committed, publish_first.published) == (26, 30)
    assert publish_first.phantom == publish_first.killed and publish_first.lost == []  # events for no order

    assert outbox.relay_kills == 2  # the relay died twice after an ack, before saving its position
    assert (outbox.committed, outbox.published) == (26, 26)  # a killed checkout's transaction rolled back whole
    assert (outbox.lost, outbox.phantom, outbox.twice) == ([], [], [])  # the resends were dropped by the window

    shown = repr(pipeline.table(commit_first, publish_first, outbox))
    assert shown.splitlines()[0].split()[:3] == ["checkout", "orders", "killed"]
    assert shown.splitlines()[1].split() == ["commit_then_publish", "30", "4", "30", "26", "4", "0", "0"]
    assert "<td><code>with_outbox</code></td><td>30</td><td>4</td>" in outbox._repr_html_()


def test_a_checkout_written_in_a_lesson_cell_runs_the_same_way(no_nats_url: None) -> None:
    async def commit_both_then_publish(env: Any, order: dict[str, Any]) -> None:
        with env.db:
            env.db.execute(INSERT_ORDER, order)
        await env.js.publish(env.placed, json.dumps(order).encode())
        env.kill_point("between", order)  # killed after both writes: nothing is lost

    result = asyncio.run(pipeline.dual_write(commit_both_then_publish, orders=10, kills=2, seed=3))
    assert result.variant == "commit_both_then_publish" and len(result.killed) == 2
    assert (result.committed, result.published, result.lost, result.phantom) == (10, 10, [], [])
