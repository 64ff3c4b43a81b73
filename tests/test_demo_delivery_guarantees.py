"""The lesson 02 experiments on a real server, in real worker processes: the counts follow the seeded
schedule, the late ack loses an order, the fenced worker does not, the timeline draws what the run
recorded. Counts and states only, no timing."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import msglab
from msglab.demos import delivery_guarantees as crashlab
from msglab.notebook import timeline

ACK_WAIT = 0.5
LABEL = "a constant the handler uses"


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


async def long_job(env: Any, msg: Any) -> None:
    for _ in range(10):
        await asyncio.sleep(0.1)  # a slice of the work itself
    await env.charge(msg.data.decode())
    await msg.ack_sync()


async def long_job_heartbeat(env: Any, msg: Any) -> None:
    for _ in range(10):
        await asyncio.sleep(0.1)
        await msg.in_progress()
    await env.charge(msg.data.decode())
    await msg.ack_sync()


async def zombie(env: Any, msg: Any) -> None:
    got = time.monotonic()
    order = msg.data.decode()
    await env.fraud_check(order)
    if time.monotonic() - got < 0.8 * ACK_WAIT:
        await env.charge(order)
    await msg.ack_sync()


async def fenced(env: Any, msg: Any) -> None:
    got = time.monotonic()
    order = msg.data.decode()
    await env.fraud_check(order)
    if time.monotonic() - got > 0.8 * ACK_WAIT:
        return
    await env.charge(order)
    await msg.ack_sync()


def uses_a_constant(env: Any, msg: Any) -> str:
    return LABEL + str(ACK_WAIT)


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
    # Every order redelivered after a kill was handled after an order published later than it.
    redelivered = {e.key for e in after.events if e.kind == "delivery" and e.detail.get("n", 1) > 1}
    assert {order for order, _ in after.reordered} == redelivered
    assert all(later > order for order, later in after.reordered)


def test_a_bare_ack_dies_with_the_process(no_nats_url: None) -> None:
    result = asyncio.run(crashlab.run(ack_buffered, messages=20, crashes=2, seed=5, points=("done",)))
    assert result.duplicated == 2 and result.lost == 0
    fig = timeline.draw(result)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels.count("kill 1") == 1 and labels.count("kill 2") == 1


def test_msg_id_drops_retried_publishes_but_not_a_redelivery_after_a_kill(no_nats_url: None) -> None:
    plain = asyncio.run(crashlab.run(ack_after, messages=30, crashes=3, seed=4, republish=4))
    dedup = asyncio.run(crashlab.run(ack_after, messages=30, crashes=3, seed=4, republish=4, msg_id=True))
    after_kills = sum(point == "after" for point, _ in dedup.schedule)
    assert (plain.published, plain.stored) == (34, 34)
    assert (dedup.published, dedup.stored) == (34, 30)
    assert plain.duplicated == after_kills + 4  # each retried publish is a new message, charged again
    assert dedup.duplicated == after_kills  # what is left is the window between the charge and the ack


def test_a_long_job_is_redelivered_to_a_second_worker_unless_it_heartbeats(no_nats_url: None) -> None:
    slow = asyncio.run(crashlab.timer_run(long_job))
    beating = asyncio.run(crashlab.timer_run(long_job_heartbeat))
    assert (slow.deliveries, slow.charges, slow.settled) == ({"A": 1, "B": 1}, 2, True)
    assert (beating.deliveries, beating.charges, beating.settled) == ({"A": 1, "B": 0}, 1, True)


def test_a_late_ack_settles_the_redelivery_and_the_order_is_lost(no_nats_url: None) -> None:
    late = asyncio.run(crashlab.timer_run(zombie, zombie=True))
    assert late.charges == 0
    assert late.deliveries == {"A": 1, "B": 1, "C": 0}
    assert (late.pending, late.ack_pending) == (0, 0)  # the broker will never deliver o-001 again
    story = late.story()
    assert any("worker B: SIGKILL before the charge" in line for line in story)
    assert story[-1].endswith("worker A: ack_sync returned (the server has it)")


def test_a_zombie_that_neither_acks_nor_works_leaves_the_order_to_the_next_delivery(no_nats_url: None) -> None:
    safe = asyncio.run(crashlab.timer_run(fenced, zombie=True))
    assert safe.charges == 1 and safe.settled
    assert sum(safe.deliveries.values()) == 3  # A's, B's (killed), and the one that charged
    charged = next(line for line in safe.story() if line.endswith(": charge"))
    assert "worker B" not in charged


def test_nak_term_and_max_deliver_counted_in_process(server: Any) -> None:
    async def body() -> list[tuple[int, bool]]:
        nc, js = await msglab.connect(server.url)
        try:
            await js.add_stream(name="DEMO_RETRY", subjects=["demo.retry.>"])
            rows = [
                await crashlab.deliveries_in(js, "DEMO_RETRY", "demo.retry.a", lambda m: m.nak(), seconds=0.3,
                                             name="a"),
                await crashlab.deliveries_in(js, "DEMO_RETRY", "demo.retry.b", lambda m: m.nak(), seconds=0.3,
                                             max_deliver=5, name="b"),
                await crashlab.deliveries_in(js, "DEMO_RETRY", "demo.retry.c", lambda m: m.term(), seconds=0.3,
                                             name="c"),
            ]  # fmt: skip
            await js.delete_stream("DEMO_RETRY")
            return rows
        finally:
            await nc.close()

    hot, capped, termed = asyncio.run(body())
    assert hot[0] > 5 and hot[1]  # an immediate nak comes straight back, and keeps coming
    assert capped == (5, False)  # max_deliver stops it; the consumer is done with it
    assert termed == (1, False)


def test_the_handler_module_carries_the_cells_constants() -> None:
    folder, path = crashlab.write_handler(uses_a_constant)
    namespace: dict[str, Any] = {}
    exec(Path(path).read_text(), namespace)  # the module this test just had written
    shutil.rmtree(folder)
    assert namespace["uses_a_constant"](None, None) == LABEL + "0.5"
    assert namespace["LABEL"] == LABEL and namespace["ACK_WAIT"] == ACK_WAIT
