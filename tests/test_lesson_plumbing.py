"""The plumbing lessons 00 and 01 call (services, charts, widgets, predictions), on a real server,
and the rules every lesson notebook keeps (folded quizzes, predictions never answered before the run).

No mocks, no sleeping to wait, no timing assertions: counts and states only. Every test uses
names of its own, so it can share the session's server with the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from matplotlib.collections import PathCollection
from nats.js.api import ConsumerConfig

import msglab
from msglab.broker.server import EmbeddedServer
from msglab.demos import request_reply_vs_events as services
from msglab.demos.request_reply_vs_events import (
    CHAIN,
    Chain,
    ChainRun,
    DiskServer,
    EmailProcess,
    EmailWorker,
    OrderDesk,
    Responder,
    Tally,
    _Downtime,
)
from msglab.notebook import charts, widgets
from msglab.notebook.predict import Prediction, parse_number
from msglab.notebook.quiz import grade_answers

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


def test_downtime_draws_at_random_from_its_seed_and_replays() -> None:
    draws = [_Downtime(0.99, "7:orders").down() for _ in range(1)]
    first = _Downtime(0.99, "7:orders")
    downs = [first.down() for _ in range(20_000)]
    again = _Downtime(0.99, "7:orders")
    assert [again.down() for _ in range(20_000)] == downs  # the same seed, the same failures
    other = _Downtime(0.99, "8:orders")
    assert [other.down() for _ in range(20_000)] != downs
    # Random, not one per block: the 100-call blocks do not all hold exactly one failure.
    blocks = {sum(downs[i : i + 100]) for i in range(0, 20_000, 100)}
    assert len(blocks) > 2 and 0 in blocks
    assert 150 < sum(downs) < 250  # about 1 % of 20,000 (seed 7: a fixed draw, not a flaky bound)
    assert draws == downs[:1]
    assert not any(_Downtime(1.0, "x").down() for _ in range(200))
    assert all(_Downtime(0.0, "x").down() for _ in range(200))


def expected_failures(availability: float, seed: int, calls: int, hops: int) -> Counter[str]:
    """Replay the chain's draws call by call: a call stops at the first service that is down."""
    schedules = {name: _Downtime(availability, f"{seed}:{name}") for name in CHAIN}
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


def test_chain_spread_runs_every_seed_through_each_chain_length(server: EmbeddedServer) -> None:
    async def body(nc: Any, js: Any) -> list[ChainRun]:
        chain = await Chain.start("plumbing.spread", url=server.url)
        try:
            return await chain.spread(nc, availability=0.99, seeds=[1, 2, 3], calls=600)
        finally:
            await chain.close()

    runs = run_with_connection(server, body)
    assert [(run.seed, run.hops) for run in runs] == [(1, 1), (1, 3), (2, 1), (2, 3), (3, 1), (3, 3)]
    for run in runs:
        assert run.down_at == expected_failures(0.99, run.seed or 0, 600, run.hops)
    pooled = services.pooled_downtime(runs, 3)
    assert pooled == sum(run.failed for run in runs if run.hops == 3) / 1800
    assert services.nearest(2.9, {"twice": 2, "three times": 3, "ten times": 10}) == "three times"
    assert services.nearest(7.0, {"twice": 2, "three times": 3, "ten times": 10}) == "ten times"


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
    seeded = [ChainRun(h, 1000, 1000 - f, Counter({CHAIN[-1]: f}), [0.001] * 1000, 0.5, seed)
              for seed, (h, f) in enumerate([(1, 1), (3, 3), (1, 2), (3, 4)])]  # fmt: skip
    downtime = charts.downtime_by_hops(seeded, 0.999)
    scatters = [c for c in downtime.axes[0].collections if isinstance(c, PathCollection)]
    heights = [row[1] for coll in scatters for row in coll.get_offsets().tolist()]  # type: ignore[union-attr]
    assert sorted(round(y, 3) for y in heights) == [0.1, 0.2, 0.3, 0.4]  # one dot per seed, in percent
    assert sorted(t.get_text() for t in downtime.axes[0].texts if t.get_text().endswith("%")) == ["0.15%", "0.35%"]
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


# --- durability: a server restarted on its store, a worker process SIGKILLed ----------------------


def test_a_restarted_server_keeps_messages_and_acks_and_a_killed_worker_loses_nothing(no_nats_url: None) -> None:
    async def body() -> tuple[list[str], Any, Counter[str], int]:
        disk = await DiskServer.start()
        try:
            await disk.js.add_stream(name="PLUMBING_DISK", subjects=["plumbing.disk.>"])
            await disk.js.add_consumer("PLUMBING_DISK", ConsumerConfig(durable_name="email", ack_wait=0.5))
            for i in range(1, 9):
                await disk.js.publish("plumbing.disk.placed", json.dumps({"id": f"d-{i}"}).encode())
            first = await EmailProcess.start(disk.url, "PLUMBING_DISK", "email", hang_after=3)
            await first.wait_emailed(3)
            await first.kill()
            port, store = disk.port, disk.store
            await disk.restart()
            assert (disk.port, disk.store, disk.restarts) == (port, store, 1)
            info = await disk.js.consumer_info("PLUMBING_DISK", "email")
            waiting = info.num_pending + info.num_ack_pending
            second = await EmailProcess.start(disk.url, "PLUMBING_DISK", "email")
            drained = await services.wait_until_waiting(disk.js, "PLUMBING_DISK", "email", 0, timeout=10)
            await second.kill()
            sent = Counter(order for order, _ in first.emailed + second.emailed)
            return [o for o, _ in first.emailed], drained, sent, waiting
        finally:
            await disk.close()

    first, drained, sent, waiting = asyncio.run(body())
    assert first == ["d-1", "d-2", "d-3"]
    assert waiting == 6  # five never delivered, and d-3: emailed, never acked (the kill came first)
    assert drained.num_pending == drained.num_ack_pending == 0
    assert set(sent) == {f"d-{i}" for i in range(1, 9)}  # none lost
    assert {o for o, n in sent.items() if n > 1} == {"d-3"}  # emailed again: its ack never reached the server


def test_wait_until_stored_sees_an_interest_stream_empty_once_acked(server: EmbeddedServer) -> None:
    from nats.js.api import RetentionPolicy

    async def body(nc: Any, js: Any) -> tuple[int, int]:
        await services.delete_stream(js, "PLUMBING_INTEREST")
        await js.add_stream(
            name="PLUMBING_INTEREST", subjects=["plumbing.interest"], retention=RetentionPolicy.INTEREST
        )
        await js.add_consumer("PLUMBING_INTEREST", ConsumerConfig(durable_name="a", ack_wait=0.5))
        for _ in range(3):
            await js.publish("plumbing.interest", b"{}")
        held = await services.wait_until_stored(js, "PLUMBING_INTEREST", 3)
        for msg in await (await js.pull_subscribe_bind("a", "PLUMBING_INTEREST")).fetch(3, timeout=1):
            await msg.ack_sync()
        after = await services.wait_until_stored(js, "PLUMBING_INTEREST", 0)
        assert await services.delete_stream(js, "PLUMBING_INTEREST")
        return held, after

    assert run_with_connection(server, body) == (3, 0)


# --- predictions and quizzes ---------------------------------------------------------------------


def test_a_prediction_compares_a_number_or_a_choice_with_what_was_measured() -> None:
    guess = Prediction("How many?")
    assert repr(guess.reveal(0, "orders")) == "You did not record a prediction; measured 0 orders."
    guess.record("1,000")
    assert guess.answer == 1000.0
    assert repr(guess.reveal(1000, "orders")) == "You said 1000; measured 1000 orders. Right."
    assert guess.reveal(1000).right and not guess.reveal(999).right
    assert repr(Prediction("x").reveal(1, "charges")) == "You did not record a prediction; measured 1 charge."
    with pytest.raises(ValueError):
        guess.record("many")
    choice = Prediction("How often?", ["about three times", "about ten times"])
    choice.record("about ten times")
    shown = choice.reveal(2.9, "times as often", choice="about three times")
    assert repr(shown) == "You said about ten times; measured 2.9 times as often (about three times)."
    assert not shown.right
    assert choice.reveal(10.2, choice="about ten times").right
    with pytest.raises(ValueError):
        choice.record("about twice")
    assert parse_number(" 0.3 % ") == 0.3 and parse_number("") is None


def test_the_predict_widget_records_only_a_typed_answer() -> None:
    guess = msglab.predict("How many of the 3 messages arrive?")
    field, button = guess.widget.children[1].children
    said = guess.widget.children[2]
    button.click()  # nothing typed: nothing recorded (an empty number field would have read as 0)
    assert guess.answer is None and "first" in said.value
    field.value = "three"
    button.click()
    assert guess.answer is None and "not a number" in said.value
    field.value = "3"
    button.click()
    assert guess.answer == 3.0 and repr(guess.reveal(3, "messages")).endswith("Right.")


# --- the rules every lesson notebook keeps ---------------------------------------------------------

LESSONS = sorted((Path(__file__).resolve().parent.parent / "lessons").glob("*.ipynb"))


def _code_cells(path: Path) -> list[dict[str, Any]]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _source(cell: dict[str, Any]) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_quiz_and_check_cell_is_folded(lesson: Path) -> None:
    for cell in _code_cells(lesson):
        source = _source(cell)
        if "quiz(" in source or source.startswith("# Check"):
            assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, source[:60]
            assert "hide-input" in cell["metadata"].get("tags", []), source[:60]


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_no_prediction_is_answered_before_its_run(lesson: Path) -> None:
    """Between a predict cell and its reveal, no cell the learner reads states an expected value."""
    cells = _code_cells(lesson)
    asked = [i for i, c in enumerate(cells) if "msglab.predict(" in _source(c)]
    assert asked, f"{lesson.name} asks for no prediction"
    for i in asked:
        reveal = next(j for j in range(i, len(cells)) if ".reveal(" in _source(cells[j]))
        for cell in cells[i : reveal + 1]:
            source = _source(cell)
            assert not re.search(r"^\s*assert\b", source, re.M), f"an assert before the reveal: {source[:80]}"
            assert not re.search(r"==\s*\d", source), f"a number compared before the reveal: {source[:80]}"


def test_quizzes_have_one_right_answer_per_question_and_feedback_for_each() -> None:
    for lesson in LESSONS:
        quiz_cell = next(c for c in _code_cells(lesson) if "quiz(" in _source(c))
        namespace: dict[str, Any] = {}
        exec(_source(quiz_cell).replace("quiz([", "questions = ([", 1), namespace)  # the data, not the widget
        questions = namespace["questions"]
        assert len(questions) >= 4, lesson.name
        for question in questions:
            assert sum(a.correct for a in question.answers) == 1, question.prompt
            assert all(a.feedback for a in question.answers), question.prompt
        right = [next(i for i, a in enumerate(q.answers) if a.correct) for q in questions]
        assert grade_answers(questions, right)[0] == len(questions)
