"""The plumbing lessons 00 and 01 call (services, charts, widgets), on a real server.

No mocks, no sleeping to wait, no timing assertions: counts and states only. Every test uses
names of its own, so it can share the session's server with the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig

import msglab
from msglab.demos import request_reply_vs_events as services
from msglab.notebook import charts, widgets
from msglab.broker.server import EmbeddedServer
from msglab.demos.request_reply_vs_events import CHAIN, Chain, ChainRun, EmailWorker, OrderDesk, Responder, Tally, _DownSchedule

PNG = b"\x89PNG\r\n\x1a\n"


def run_with_connection(server: EmbeddedServer, body: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """Connect to the test server, run body(nc, js), always close the connection."""

    async def main() -> Any:
        nc, js = await msglab.connect(server.url)
        try:
            return await body(nc, js)
        finally:
            await nc.close()

    return asyncio.run(main())


# --- Responder -----------------------------------------------------------------------------------


def test_responder_answers_fails_fast_when_down_and_times_out_when_silent(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> None:
        email = await Responder.start("plumbing.email.send", answer=lambda data: b"sent " + data, url=server.url)
        try:
            assert (await nc.request("plumbing.email.send", b"o-1", timeout=1)).data == b"sent o-1"
            await email.down()
            with pytest.raises(nats.errors.NoRespondersError):
                await nc.request("plumbing.email.send", b"o-2", timeout=1)
            await email.silent()
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request("plumbing.email.send", b"o-3", timeout=0.1)
            await email.up()
            assert (await nc.request("plumbing.email.send", b"o-4", timeout=1)).data == b"sent o-4"
            # The one that was down never reached it; the silent one did, and got no answer.
            assert (email.received, email.answered, email.state) == (3, 2, "up")
        finally:
            await email.close()

    run_with_connection(server, body)


def test_every_state_change_is_seen_by_the_very_next_request_from_another_connection(server: EmbeddedServer) -> None:
    # A plain nc.flush() after an (un)subscribe let about one request in five see the old state.
    async def body(nc: Any, js: Any) -> list[str]:
        stock = await Responder.start("plumbing.flip", answer=b"7", url=server.url)
        seen = []
        try:
            for _ in range(100):
                await stock.down()
                try:
                    await nc.request("plumbing.flip", b"", timeout=1)
                    seen.append("answered while down")
                except nats.errors.NoRespondersError:
                    pass
                await stock.up()
                try:
                    await nc.request("plumbing.flip", b"", timeout=1)
                except nats.errors.NoRespondersError:
                    seen.append("no responders while up")
        finally:
            await stock.close()
        return seen

    assert run_with_connection(server, body) == []


def test_responder_refuses_an_unknown_state(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> None:
        email = await Responder.start("plumbing.refuse", url=server.url)
        try:
            with pytest.raises(ValueError, match="state must be one of"):
                await email.set_state("sleepy")
            assert email.state == "up"
        finally:
            await email.close()

    run_with_connection(server, body)


# --- Chain ---------------------------------------------------------------------------------------


def test_down_schedule_is_down_for_exactly_its_share_of_each_block() -> None:
    schedule = _DownSchedule(0.999, "7:orders")
    downs = [schedule.down() for _ in range(3000)]
    assert schedule.size == 1000
    assert [sum(downs[i : i + 1000]) for i in (0, 1000, 2000)] == [1, 1, 1]
    again = _DownSchedule(0.999, "7:orders")
    assert [again.down() for _ in range(3000)] == downs  # the same seed, the same failures
    assert (_DownSchedule(0.98, "x").size, _DownSchedule(0.98, "x").downs) == (100, 2)
    assert (_DownSchedule(0.9995, "x").size, _DownSchedule(0.9995, "x").downs) == (10_000, 5)
    assert not any(_DownSchedule(1.0, "x").down() for _ in range(200))


def expected_failures(availability: float, seed: int, calls: int, hops: int) -> Counter[str]:
    """Replay the chain's schedules call by call: a call stops at the first service that is down."""
    schedules = {name: _DownSchedule(availability, f"{seed}:{name}") for name in CHAIN}
    failed: Counter[str] = Counter()
    for _ in range(calls):
        down = next((name for name in CHAIN[len(CHAIN) - hops :] if schedules[name].down()), None)
        if down:
            failed[down] += 1
    return failed


def test_chain_fails_exactly_the_scheduled_calls_even_with_many_in_flight(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> list[ChainRun]:
        chain = await Chain.start("plumbing.chain", url=server.url)
        try:
            runs = []
            for hops in (1, 3):
                chain.configure(availability=0.98, seed=5)
                runs.append(await chain.run(nc, calls=2000, hops=hops, concurrency=50))
            return runs
        finally:
            await chain.close()

    one, three = run_with_connection(server, body)
    # Each service draws in the order calls reach it; how many fail does not depend on that order.
    assert one.down_at == expected_failures(0.98, 5, 2000, 1)
    assert three.down_at == expected_failures(0.98, 5, 2000, 3)
    assert set(three.down_at) == set(CHAIN)  # every service contributed failures of its own
    assert three.ok + sum(three.down_at.values()) == three.calls == len(three.latencies)
    assert three.downtime > one.downtime


def test_chain_latency_run_answers_every_call_through_every_hop(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> list[ChainRun]:
        chain = await Chain.start("plumbing.healthy", url=server.url)
        try:
            return await chain.latency(nc, calls=30)
        finally:
            await chain.close()

    runs = run_with_connection(server, body)
    assert [(run.hops, run.ok, run.availability, len(run.latencies)) for run in runs] == [
        (1, 30, 1.0, 30),
        (2, 30, 1.0, 30),
        (3, 30, 1.0, 30),
    ]
    assert all(run.down_at == Counter() for run in runs)


def test_chain_call_fails_at_the_entry_when_everything_is_down(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> list[ChainRun]:
        chain = await Chain.start("plumbing.dead", availability=0.0, url=server.url)
        try:
            return [await chain.run(nc, calls=10, hops=hops) for hops in (1, 3)]
        finally:
            await chain.close()

    one, three = run_with_connection(server, body)
    assert one.down_at == Counter(payments=10) and three.down_at == Counter(orders=10)


def test_a_stopped_chain_fails_its_calls_at_the_entry_instead_of_raising(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> ChainRun:
        chain = await Chain.start("plumbing.stopped", url=server.url)
        await chain.close()
        return await chain.run(nc, calls=3, hops=3)

    run = run_with_connection(server, body)
    assert run.ok == 0 and run.down_at == Counter(orders=3)  # no responders at the entry


# --- EmailWorker and OrderDesk -------------------------------------------------------------------


def test_email_worker_catches_up_on_what_was_published_while_it_was_down(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> None:
        await services.delete_stream(js, "PLUMBING_WORKER")
        await js.add_stream(name="PLUMBING_WORKER", subjects=["plumbing.worker.>"])
        await js.add_consumer("PLUMBING_WORKER", ConsumerConfig(durable_name="email", ack_wait=0.5))
        worker = EmailWorker("PLUMBING_WORKER", "email", url=server.url)
        try:
            for i in range(5):  # published before the worker ever ran
                await js.publish("plumbing.worker.placed", json.dumps({"id": f"o-{i}"}).encode())
            await worker.up()
            await worker.wait_for({f"o-{i}" for i in range(5)})
            await worker.down()
            for i in range(5, 8):
                await js.publish("plumbing.worker.placed", json.dumps({"id": f"o-{i}"}).encode())
            info = await services.wait_until_waiting(js, "PLUMBING_WORKER", "email", 3)
            assert info.num_pending + info.num_ack_pending == 3 and not worker.running
            await worker.up()
            await worker.wait_for({f"o-{i}" for i in range(8)})
            assert set(worker.emailed) == {f"o-{i}" for i in range(8)}
        finally:
            await worker.close()
            assert await services.delete_stream(js, "PLUMBING_WORKER")

    run_with_connection(server, body)


def test_order_desk_counts_each_way_as_services_go_up_down_and_silent(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> list[Any]:
        desk = await OrderDesk.open(nc, js, prefix="plumbing.desk", stream="PLUMBING_DESK", timeout=0.1, url=server.url)
        seen: list[Any] = []
        try:
            tally = await desk.fire(3)
            seen.append((tally.accepted("request_reply"), tally.accepted("event"), tally.emailed, tally.waiting))
            await desk.set_state("email", "down")
            tally = await desk.fire(4)
            seen.append((tally.request_reply["email: no responders"], tally.accepted("event"), tally.waiting))
            await desk.set_state("email", "silent")
            tally = await desk.fire(2)
            seen.append((tally.request_reply["email: timed out"], tally.accepted("event"), tally.waiting))
            await desk.set_state("inventory", "down")
            tally = await desk.fire(1)
            seen.append((tally.request_reply["inventory: no responders"], tally.event["inventory: no responders"]))
            await desk.set_state("inventory", "up")
            await desk.set_state("email", "up")
            tally = await desk.settle()
            seen.append((tally.emailed, tally.waiting, tally.refused("request_reply"), tally.refused("event")))
            seen.append(tally.states)
        finally:
            await desk.close()
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info("PLUMBING_DESK")
        return seen

    assert run_with_connection(server, body) == [
        (3, 3, 3, 0),  # all up: both ways accept, the worker emails
        (4, 7, 4),  # email down: waiting for email refuses; events are accepted and wait
        (2, 9, 6),  # email silent: the same, after the timeout
        (1, 1),  # inventory down: both ways refuse, an event cannot answer a question
        (9, 0, 7, 1),  # email back: the worker catches up on every accepted event
        {"inventory": "up", "email": "up"},
    ]


# --- charts and the control ----------------------------------------------------------------------


def test_charts_draw_what_they_are_given() -> None:
    runs = [ChainRun(h, 1000, 1000 - h, Counter({CHAIN[-h]: h}), [0.001 * h] * 1000, 0.5) for h in (1, 2, 3)]
    latency = charts.latency_by_hops(runs)
    assert len(latency.axes[0].patches) == 3
    assert len(charts.latency_by_hops(runs, work=0.005).axes[0].patches) == 6  # work, then messaging
    downtime = charts.downtime_by_hops(runs, 0.999)
    assert [round(bar.get_height(), 3) for bar in downtime.axes[0].patches] == [0.1, 0.2, 0.3]
    assert len(charts.queue_depth([300, 250, 0]).axes[0].lines) == 1
    tally = Tally(
        Counter(accepted=2, **{"email: no responders": 3}),
        Counter(accepted=5),
        emailed=2,
        waiting=3,
        states={"email": "down"},
    )
    outcomes = charts.order_outcomes(tally)
    assert len(outcomes.axes) == 2
    assert charts.png(outcomes).startswith(PNG)


def test_desk_control_applies_clicks_in_order_and_redraws(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> None:
        desk = await OrderDesk.open(
            nc, js, prefix="plumbing.panel", stream="PLUMBING_PANEL", timeout=0.1, url=server.url
        )
        try:
            control = await widgets.order_desk(desk)
            assert bytes(control.image.value).startswith(PNG) and "ready" in control.status.value
            control.toggles["email"].value = "down"
            control.n.value = 4
            control.fire_button.click()
            await control.idle()
            assert desk.services["email"].state == "down" and desk.worker is not None and not desk.worker.running
            tally = await desk.tally()
            assert tally.request_reply["email: no responders"] == 4 and tally.waiting == 4
            assert "4 refused" in control.status.value
            assert "application/vnd.jupyter.widget-view+json" in control._repr_mimebundle_()
        finally:
            await desk.close()
        control.fire_button.click()  # on a closed desk: a message in the panel, no exception
        await control.idle()
        assert "re-run the cells above" in control.status.value

    run_with_connection(server, body)


def test_delete_stream_says_whether_there_was_one(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> tuple[bool, bool]:
        await js.add_stream(name="PLUMBING_GONE", subjects=["plumbing.gone"])
        return await services.delete_stream(js, "PLUMBING_GONE"), await services.delete_stream(js, "PLUMBING_GONE")

    assert run_with_connection(server, body) == (True, False)
