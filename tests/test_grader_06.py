"""Lab 06's grader on what no variant's verdict shows: the throughput judgement (two ratios), the
ledger's final state after a late duplicate, what the learner's permissions allow on the lab's
stream (its own durables, never the stream), and the lab notebook's order on hold, by hand.
(What each variant's verdict must say is its `Says:` lines, graded in tests/test_variants.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from msglab.graders import partition_keys
from msglab.graders.partition_keys import (
    ACK_WAIT_MAX,
    PARALLEL,
    SPREAD,
    Measured,
    _ack_wait_check,
    _order_of,
    _out_of_order,
    _parallel_share,
    _throughput_check,
    effect_key,
)
from msglab.world import order_events as oe


def test_throughput_is_judged_on_the_busiest_workers_share_and_applies_side_by_side_never_a_time() -> None:
    events = 144
    fair = int(events / SPREAD) - 1  # just under the bound
    side_by_side = {1: Measured(2.4, True, events), 4: Measured(2.0, True, fair, PARALLEL + 0.01)}
    assert _throughput_check(side_by_side, events).passed  # 1.2 times faster only (a starved CPU): still a pass
    slow = {n: Measured(m.span * 10, True, m.busiest, m.parallel) for n, m in side_by_side.items()}
    assert _throughput_check(slow, events).passed  # ten times slower everywhere: the same verdict
    hot = {1: Measured(2.4, True, events), 4: Measured(0.8, True, int(events / SPREAD) + 1, 0.9)}
    check = _throughput_check(hot, events)
    assert not check.passed and "hot partition" in check.message, check.message
    turns = {1: Measured(2.4, True, events), 4: Measured(2.5, True, events // 4, 0.0)}
    check = _throughput_check(turns, events)
    assert not check.passed and "took turns" in check.message and "serialise" in check.hint, check.message
    unfinished = {1: Measured(6.0, False, 100)}
    check = _throughput_check(unfinished, events)
    assert not check.passed and check.message.startswith("could not be measured"), check.message


def test_the_parallel_share_counts_only_time_two_workers_applied_at_once() -> None:
    def applied(worker: str, start: float, end: float) -> oe.Applied:
        return oe.Applied("o-1", 1, "created", worker, start, end)

    one_after_another = [applied("a", 0, 1), applied("b", 1, 2), applied("a", 2, 3)]
    assert _parallel_share(one_after_another, 3.0) == 0.0
    side_by_side = [applied("a", 0, 2), applied("b", 1, 3), applied("c", 1.5, 2.5)]
    assert _parallel_share(side_by_side, 3.0) == (2 - 1) / 3 + (2.5 - 2) / 3


def test_a_late_duplicate_sets_the_order_back_in_the_ledger() -> None:
    created, paid, shipped = (oe.Event("o-1", s, k, "c") for s, k in enumerate(("created", "paid", "shipped"), 1))
    ledger = oe.Ledger([created, paid, shipped])
    for event in (created, paid, shipped, created):  # a stalled worker's "created", applied again at the end
        ledger.apply(event, "w")
    report = ledger.report()
    assert (report.violations, report.duplicates, report.wrong_final) == (0, 1, 1)


def test_a_repeat_applied_after_its_orders_next_event_breaks_the_order_though_rule_6_excuses_the_repeat() -> None:
    created, paid, shipped = (oe.Event("o-1", s, k, "c") for s, k in enumerate(("created", "paid", "shipped"), 1))
    shop: Any = SimpleNamespace(ledger=oe.Ledger([created, paid, shipped]))
    for event in (created, paid, created):  # the crash's redelivery, applied again behind "paid"
        shop.ledger.apply(event, "w")
    assert [(a.seq, after) for a, after in _out_of_order(shop)] == [(1, 2)]
    shop.ledger.clear()
    for event in (created, paid, paid, shipped):  # applied again at once, before anything later: in order
        shop.ledger.apply(event, "w")
    assert _out_of_order(shop) == []


def test_an_apply_names_one_published_event_and_crashes_are_told_by_their_order() -> None:
    event = oe.Event("o-0012", 2, "paid", "c-01")
    assert effect_key(event) == "o-0012#2" and _order_of(effect_key(event)) == "o-0012"
    assert _order_of(None) == ""


def test_every_durables_ack_wait_is_read_against_the_readmes_bound() -> None:
    def durable(name: str, ack_wait: float) -> Any:
        return SimpleNamespace(name=name, config=SimpleNamespace(ack_wait=ack_wait, durable_name=name))

    assert _ack_wait_check([durable("n2p0", 0.5), durable("n2p1", ACK_WAIT_MAX)]).passed
    check = _ack_wait_check([durable("n2p0", 0.5), durable("n3p1", 3.0)])
    assert not check.passed and "n3p1" in check.message and "3.0 s" in check.message, check.message


def test_the_learner_creates_its_own_durables_and_publishes_under_shop_but_never_changes_the_stream(
    tmp_path: Path,
) -> None:
    import nats
    from nats.js.api import ConsumerConfig, StreamConfig

    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import LEARNER_INBOX, RunUsers

    users = RunUsers(grader=partition_keys)  # the permissions a grading run of lab 06 gives the learner
    config = tmp_path / "server.conf"
    config.write_text(users.config())

    async def attempts(grader_url: str, learner_url: str) -> tuple[list[str], list[str]]:
        grader = await nats.connect(grader_url)
        await grader.jetstream().add_stream(StreamConfig(name="SHOP_EVENTS", subjects=["shop.>"]))
        learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX)
        js = learner.jetstream()
        done: list[str] = []
        await js.publish("shop.2.1.o-1", oe.Event("o-1", 1, "created", "c").to_bytes())
        done.append("published")
        await js.add_consumer(
            "SHOP_EVENTS", ConsumerConfig(name="n2p1", durable_name="n2p1", filter_subject="shop.2.1.*")
        )
        sub = await js.pull_subscribe_bind("n2p1", "SHOP_EVENTS")
        [msg] = await sub.fetch(1, timeout=2)
        await msg.ack_sync()
        done.append("own durable: fetched and acked")
        refused: list[str] = []
        stream = StreamConfig(name="SHOP_EVENTS", subjects=["shop.>", "other.>"])
        for attempt in (
            js.update_stream(stream),
            js.delete_consumer("SHOP_EVENTS", "n2p1"),
            js.purge_stream("SHOP_EVENTS"),
        ):
            try:
                await attempt
            except Exception as exc:  # the server's permission refusal times the request out
                refused.append(type(exc).__name__)
        await learner.close()
        await grader.close()
        return done, refused

    with EmbeddedServer(config=str(config)) as server:
        done, refused = asyncio.run(attempts(users.grader_url(server.url), users.learner_url(server.url)))
    assert done == ["published", "own durable: fetched and acked"]
    assert len(refused) == 3, refused


def test_the_playground_refuses_the_first_order_for_a_while_and_the_solution_parks_it(no_nats_url: None) -> None:
    import msglab

    async def by_hand() -> list[str]:
        made, lab = await msglab.playground("06", solution=True)
        env: Any = made
        applied: list[str] = []
        apply = env.apply

        async def recording(event: Any) -> None:
            await apply(event)
            applied.append(f"{event.key} {event.seq}")

        env.apply = recording
        try:
            events = oe.workload(seed=6, orders=4)
            for event in events:
                await lab.publish(env, event, 2)
            workers = asyncio.gather(*(lab.worker(env, p, 2, 0) for p in range(2)))
            with contextlib.suppress(TimeoutError):  # workers run until stopped: here 2 s past the 2 s hold
                await asyncio.wait_for(workers, timeout=4.0)
            return applied
        finally:
            await msglab.playground_close(env)

    applied = asyncio.run(by_hand())
    assert len(applied) == 12, applied  # 4 orders of 3 events, each applied once
    held = applied[-1].split()[0]  # the order on hold: everyone else went first, then its events in order
    assert applied[-3:] == [f"{held} 1", f"{held} 2", f"{held} 3"], applied


def _rescaled(applies: list[tuple[int, str, float, float]]) -> Any:
    """A shop whose order o-1 straddles the rescale (created, paid with n=2; shipped with n=3), applied as listed:
    (seq, worker, start, end)."""
    events = [oe.Event("o-1", s, k, "c") for s, k in enumerate(("created", "paid", "shipped"), 1)]
    ledger = oe.Ledger(events)
    ledger.log += [
        oe.Applied("o-1", seq, events[seq - 1].kind, worker, start, end) for seq, worker, start, end in applies
    ]
    return SimpleNamespace(
        ledger=ledger,
        layout={("o-1", 1): 2, ("o-1", 2): 2, ("o-1", 3): 3},
        events={(e.key, e.seq): e for e in events},
        run=SimpleNamespace(log=SimpleNamespace(events=lambda *kinds: [])),
        trace=lambda key: [],
    )


def test_a_new_owner_that_starts_before_the_old_layout_finished_the_order_fails_whoever_the_broker_served_first() -> (
    None
):
    from msglab.graders.partition_keys import _order_check, _owner_check, _rescale_check

    waited = _rescaled([(1, "old", 0.0, 0.1), (2, "old", 0.1, 0.3), (3, "new", 0.4, 0.5)])
    assert _owner_check(waited).passed and _rescale_check(waited, {"o-1"}).passed
    # The same mistake (the new layout did not wait), three ways the race can go: the new owner's apply runs
    # alongside the old one's, or before it started, or the old owner's paid ends first though it started later.
    during = _rescaled([(1, "old", 0.0, 0.1), (3, "new", 0.15, 0.16), (2, "old", 0.1, 0.3)])
    before = _rescaled([(1, "old", 0.0, 0.04), (3, "new", 0.05, 0.06), (2, "old", 0.2, 0.4)])
    for shop in (during, before):
        check = _owner_check(shop)
        assert not check.passed and "held by two workers at once" in check.message, check.message
        assert "worker new began applying o-1's shipped (event 3)" in check.message, check.message
    assert "still applying its paid" in _owner_check(during).message
    assert "published with n=2, was applied: worker old" in _owner_check(before).message
    # The inversion across the layouts is the rescale's mistake, not per_key_order's.
    assert not _rescale_check(before, {"o-1"}).passed and _order_check(before, exclude=set()).passed


def test_an_inversion_within_one_layout_is_per_key_order_s_also_for_an_order_that_straddles_the_rescale() -> None:
    from msglab.graders.partition_keys import _order_check, _owner_check, _rescale_check

    # paid applied, then created redelivered after it (one old worker, a crash's redelivery behind its next event)
    late = _rescaled([(2, "old", 0.0, 0.1), (1, "old", 0.2, 0.3), (3, "new", 0.4, 0.5)])
    check = _order_check(late, exclude=set())
    assert not check.passed and "created (event 1) applied by worker old after its paid" in check.message
    assert _rescale_check(late, {"o-1"}).passed and _owner_check(late).passed


def test_the_burst_waits_until_every_new_worker_asked_again_after_an_empty_fetch_or_ended() -> None:
    from msglab.graders.partition_keys import Slot, _idle_or_gone
    from msglab.grading.observe import BrokerWatch, Pull

    running: Any = SimpleNamespace(alive=True, died=None, returned=False)
    slots = [Slot(p, 3, 2, child=running) for p in range(3)]
    watch = BrokerWatch("S", "*")
    watch.pulls = [Pull(10.0, 1, 0.2, True, "_INBOX.a"), Pull(10.3, 1, 0.2, True, "_INBOX.a")]  # a asked again
    watch.pulls += [Pull(10.0, 1, 0.2, True, "_INBOX.b")]  # b's fetch has not run out yet
    assert not _idle_or_gone(watch, 9.0, slots)
    watch.pulls += [Pull(10.25, 1, 0.2, True, "_INBOX.b"), Pull(10.1, 1, 0.2, True, "_INBOX.c")]
    assert not _idle_or_gone(watch, 9.0, slots)  # c has not asked again
    assert not _idle_or_gone(watch, 10.2, slots)  # what came before `since` is no evidence
    returned: Any = SimpleNamespace(alive=False, died=None, returned=True)
    slots[2].child = returned
    assert _idle_or_gone(watch, 9.0, slots)  # c's worker returned: it will not ask again


def test_the_planned_stall_lands_on_the_straddling_order_whose_two_sides_sit_closest_in_the_stream() -> None:
    from msglab.graders.partition_keys import _straddler

    def e(key: str, seq: int) -> oe.Event:
        return oe.Event(key, seq, "created", "c")

    # cut at 5: o-1 spans indices 2 -> 6, o-2 4 -> 7, o-3 3 -> 5 (the closest), o-4 never straddles
    orders = [e("o-1", 1), e("o-2", 1), e("o-1", 2), e("o-3", 1), e("o-2", 2)]
    orders += [e("o-3", 2), e("o-1", 3), e("o-2", 3), e("o-4", 1)]
    assert _straddler(orders, 5) == (orders[3], orders[5])
    # The workload is seeded, so the stall is too: every grading of a seed stalls the same event.
    seeded = oe.workload(7, orders=24, overlap=8)
    cut = len(seeded) * 5 // 8
    old, new = _straddler(seeded, cut)
    assert old.key == new.key and seeded.index(old) < cut <= seeded.index(new)
    assert _straddler(oe.workload(7, orders=24, overlap=8), cut) == (old, new)


def test_a_deliverys_reply_subject_names_its_durable_and_stream_sequence() -> None:
    from msglab.graders.partition_keys import _ack_tokens

    assert _ack_tokens("$JS.ACK.SHOP.n2p0.1.17.9.1700000000000000000.3") == ("n2p0", 17)
    assert _ack_tokens("$JS.ACK.hub.ACCHASH.SHOP.n2p0.2.17.9.1700000000000000000.3.tok") == ("n2p0", 17)
    assert _ack_tokens("_INBOX_learner.w3.abc") == ("", 0)


def test_a_hold_lasts_while_its_durable_hands_events_out_and_ends_once_it_has_nothing_more_to_hand_out(
    monkeypatch: Any,
) -> None:
    from msglab.graders.partition_keys import Shop

    monkeypatch.setattr(partition_keys, "QUIET", 0.1)

    async def caught_up() -> None:
        return None

    watch: Any = SimpleNamespace(deliveries={}, caught_up=caught_up)
    shop = Shop(SimpleNamespace(on=lambda *_: None), oe.Ledger(), watch, SimpleNamespace())  # type: ignore[arg-type]

    def deliver(durable: str, n: int) -> None:
        watch.deliveries[f"$JS.ACK.SHOP.{durable}.1.{n}.{n}.0.0"] = 0.0

    async def scenario() -> tuple[int, int, bool]:
        fed = 0

        async def feed() -> None:  # the shared durable keeps handing events to other workers for a while
            nonlocal fed
            for n in range(1, 31):
                deliver("all", n)
                deliver("n2p1", 100 + n)  # another durable's traffic is no movement of this one's
                fed = n
                await asyncio.sleep(0.01)

        feeder = asyncio.ensure_future(feed())
        await shop.until_quiet({"all"}, lambda: False, lambda: 0.0)
        at_release = fed
        await feeder
        ready = False
        # Not ready (e.g. the replacement has not asked yet): no quiet counts, whatever the time; done() ends it.
        waited = asyncio.ensure_future(shop.until_quiet({"all"}, lambda: ready, lambda: None))
        await asyncio.sleep(0.3)
        still = not waited.done()
        ready = True
        await waited
        return at_release, fed, still

    at_release, fed, still = asyncio.run(scenario())
    assert at_release == fed == 30 and still


def test_the_stall_holds_a_worker_only_where_another_running_worker_pulls_its_durable_until_the_race_is_run() -> None:
    from msglab.graders.partition_keys import Shop, Stall
    from msglab.grading.observe import Pull
    from msglab.grading.rules import Planned

    async def caught_up() -> None:
        return None

    async def no_info(*_: Any) -> Any:
        raise LookupError("no such durable")  # the broker's ack_wait unknown: the stall reads it as 0 s

    def worker(pid: int) -> Any:
        return SimpleNamespace(pid=pid, role="worker", inbox=f"_INBOX_learner.w{pid}", alive=True, died=None,
                               returned=False)  # fmt: skip

    old, new = oe.Event("o-1", 2, "paid", "c"), oe.Event("o-1", 3, "shipped", "c")
    a, b = worker(1), worker(2)
    run: Any = SimpleNamespace(on=lambda *_: None, children=[a, b], js=SimpleNamespace(consumer_info=no_info),
                               names=SimpleNamespace(stream=lambda name: name))  # fmt: skip
    watch: Any = SimpleNamespace(
        deliveries={}, caught_up=caught_up, pulls=[Pull(0.0, 1, 0.2, False, "_INBOX_learner.w1.x", "n2p0")]
    )
    shop = Shop(run, oe.Ledger([old, new]), watch, SimpleNamespace())  # type: ignore[arg-type]

    async def own_durable() -> Stall:
        stall = Stall(old, new, Planned("stall", "hint"))
        await shop.stalled(a, stall)
        return stall

    stall = asyncio.run(own_durable())
    assert stall.planned.fired and not stall.shared and stall.ended == stall.began

    watch.pulls.append(Pull(0.0, 1, 0.2, False, "_INBOX_learner.w2.y", "n2p0"))  # b pulls a's durable too
    shop.published[(new.key, new.seq)] = 0.0

    async def shared_durable() -> tuple[Stall, bool]:
        stall = Stall(old, new, Planned("stall", "hint"))
        shop.stall = stall
        held = asyncio.ensure_future(shop.stalled(a, stall))
        for n in range(20):  # b takes the stalled event, and the durable keeps handing events out meanwhile
            watch.deliveries[f"$JS.ACK.SHOP.n2p0.1.{n}.{n}.0.0"] = 0.0
            await asyncio.sleep(0.01)
        stall.taken_by = b.pid
        still = not held.done()  # the order's next event has not been applied yet
        shop.ledger.apply(new, "2")
        await held
        return stall, still

    stall, still = asyncio.run(shared_durable())
    assert stall.shared and stall.taken_by == b.pid and still
