"""Lesson 06's experiments on a real server with worker processes, and the order-event world they share:
counts and orders only, never seconds."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from msglab.demos import partition_keys as pk
from msglab.world import order_events as oe

EVENTS = oe.workload(seed=3, orders=30, overlap=8)


def run(experiment: Callable[[pk.Shop], Awaitable[Any]], workers: int = 4) -> Any:
    """Open the lesson's shop, run one experiment, close it."""

    async def main() -> Any:
        shop = await pk.Shop.open(workers=workers)
        try:
            return await experiment(shop)
        finally:
            await shop.close()

    return asyncio.run(main())


# --- the world: workload, partitions, ledger (no server) ---------------------------------------------


def test_a_workload_is_a_value_of_its_seed() -> None:
    assert oe.workload(5, orders=40) == oe.workload(5, orders=40) != oe.workload(6, orders=40)
    events = oe.workload(5, orders=40)
    assert len(events) == 120 and [e.n for e in events] == list(range(120))
    for key in {e.key for e in events}:
        mine = [e for e in events if e.key == key]
        assert [e.seq for e in mine] == [1, 2, 3]  # published in each order's own order
        assert [e.kind for e in mine][:2] == ["created", "paid"] and mine[2].kind in ("shipped", "cancelled")
    assert oe.Event.from_bytes(events[7].to_bytes()) == events[7]


def test_a_skewed_workload_makes_a_hot_partition_by_customer_not_by_order() -> None:
    events = oe.workload(11, orders=1000)
    by_order, by_customer = oe.spread([e.key for e in events], 4), oe.spread([e.customer for e in events], 4)
    assert sum(by_order) == sum(by_customer) == 3000
    assert max(by_customer) > 1.3 * max(by_order)


def test_the_hash_is_fnv1a_32() -> None:
    assert oe.fnv1a32(b"") == 0x811C9DC5 and oe.fnv1a32(b"a") == 0xE40C292C  # the published test vectors
    assert oe.partition("a", 7) == 0xE40C292C % 7


def test_modulo_moves_about_n_over_n_plus_1_of_the_keys_jump_hashing_about_1_over_n_plus_1() -> None:
    keys = [f"o-{i}" for i in range(20_000)]
    for n in (2, 4, 8):
        assert abs(oe.moved(keys, oe.partition, n) - n / (n + 1)) < 0.02
        assert abs(oe.moved(keys, oe.jump, n) - 1 / (n + 1)) < 0.02
        # Jump hashing only ever moves a key into the new partition.
        assert all(oe.jump(k, n + 1) in (oe.jump(k, n), n) for k in keys[:2000])


def test_the_ledger_counts_order_violations_duplicates_missing_and_wrong_final_states() -> None:
    events = [oe.Event("o-1", 1, "created", "c"), oe.Event("o-1", 2, "paid", "c"), oe.Event("o-1", 3, "cancelled", "c"),
              oe.Event("o-2", 1, "created", "c"), oe.Event("o-2", 2, "paid", "c")]  # fmt: skip
    ledger = oe.Ledger(events)
    for i in (0, 2, 1, 1, 3):  # o-1's payment after its cancellation, twice; o-2 never paid
        ledger.apply(events[i], "w")
    report = ledger.report()
    # Both orders end in the wrong state: o-1 "paid" though cancelled, o-2 "created" though paid.
    assert (report.violations, report.duplicates, report.missing, report.wrong_final) == (1, 1, 1, 2)
    assert report.examples == ["o-1: paid (event 2) applied after event 3"]


def test_the_ledger_sees_a_key_held_by_two_workers_at_once() -> None:
    a, b = oe.Event("o-1", 1, "created", "c"), oe.Event("o-1", 2, "paid", "c")
    ledger = oe.Ledger([a, b])
    ledger.apply(a, "w1", start=0.0)  # held from 0 until now
    ledger.apply(b, "w2", start=0.0)
    assert ledger.overlaps() == 1
    ledger.clear()
    ledger.apply(a, "w1", start=0.0)
    ledger.apply(b, "w1", start=0.0)  # one worker: never a second holder
    assert ledger.overlaps() == 0


# --- the lesson's experiments on a real server --------------------------------------------------------


def test_a_redelivery_after_a_kill_lands_after_the_keys_later_events(no_nats_url: None) -> None:
    crash = run(lambda shop: shop.shared(EVENTS, workers=2, kill=True))
    first = EVENTS[0]
    assert crash.extra["killed holding"] == f"{first.key} {first.kind}"
    assert crash.extra[f"{first.key}'s events applied in the order"][-1] == 1  # redelivered after ack_wait
    assert crash.report.violations >= 1 and crash.report.missing == 0


def test_max_ack_pending_1_keeps_each_keys_order_through_a_kill(no_nats_url: None) -> None:
    async def experiment(shop: pk.Shop) -> tuple[pk.Run, pk.Run]:
        return await shop.shared(EVENTS, workers=2, max_ack_pending=1), await shop.shared(
            EVENTS, workers=2, max_ack_pending=1, kill=True
        )

    serial, crash = run(experiment)
    assert serial.report.violations == crash.report.violations == 0
    assert crash.extra[f"{EVENTS[0].key}'s events applied in the order"] == [1, 2, 3]
    assert serial.report.distinct == crash.report.distinct == len(EVENTS)


def test_a_worker_that_outlives_ack_wait_has_its_event_applied_twice_even_with_max_ack_pending_1(
    no_nats_url: None,
) -> None:
    stalled = run(lambda shop: shop.shared(EVENTS, workers=2, max_ack_pending=1, stall=1.2))
    first = EVENTS[0]
    applied = stalled.extra[f"{first.key}'s events applied (event, worker)"]
    # The broker handed the event to w2 after ack_wait; w1, quiet but alive, applied it again later (after
    # w2's later events of the order when idle; under load it can come before some of them).
    assert applied[0] == (first.kind, "w2") and (first.kind, "w1") in applied[1:]
    assert stalled.report.duplicates == 1 and stalled.report.missing == 0


def test_an_event_that_runs_out_of_max_deliver_is_skipped_and_its_keys_later_events_flow(no_nats_url: None) -> None:
    handed = run(lambda shop: shop.runs_out(EVENTS, max_deliver=2), workers=0)
    last = [e.kind for e in EVENTS if e.key == EVENTS[0].key][-1]
    # Naked twice, "created" is dropped for good; the order's payment and last event are applied without it.
    assert handed == ["created #1", "created #2", "paid #1", f"{last} #1"]


def test_one_worker_per_partition_keeps_order_and_the_server_partitions_by_fnv1a(no_nats_url: None) -> None:
    four = run(lambda shop: shop.partitioned(EVENTS, 4))
    assert four.report.violations == 0 and four.report.missing == 0 and four.report.overlaps == 0
    server = four.extra["server's partition per key"]
    assert len(server) == 30 and all(oe.partition(key, 4) == p for key, p in server.items())
    assert sum(four.extra["stored per partition"]) == len(EVENTS)
    assert len(four.report.by_worker) == 4  # every partition had its own worker


def test_rescaling_keeps_order_only_when_the_old_partitions_drain_first(no_nats_url: None) -> None:
    async def experiment(shop: pk.Shop) -> tuple[pk.Run, pk.Run]:
        events = oe.workload(seed=3, orders=50, overlap=8)
        return await shop.rescale(events, 2, drain_first=False), await shop.rescale(events, 2, drain_first=True)

    direct, drained = run(experiment)
    moved = direct.extra["moved"]
    assert moved and all(oe.partition(k, 2) != oe.partition(k, 3) for k in moved)
    # Modulo sends a moved key to another old partition as often as to the new one: in both cases its
    # new events are applied while its old ones wait in the old partition's backlog.
    assert any(not way.endswith("p2") for way in moved.values())
    assert direct.report.violations > 0
    assert drained.report.violations == 0
    assert direct.report.missing == drained.report.missing == 0


def test_a_poison_event_blocks_its_partition_breaks_its_keys_order_if_dead_lettered_not_if_parked(
    no_nats_url: None,
) -> None:
    bad = next(e for e in EVENTS if e.kind == "paid" and any(x.key == e.key and x.kind == "cancelled" for x in EVENTS))

    async def experiment(shop: pk.Shop) -> dict[str, pk.Run]:
        return {s: await shop.poison(EVENTS, bad, s) for s in ("retry", "dead-letter", "park")}

    runs = run(experiment, workers=0)
    behind = runs["retry"].extra["events behind the poison"]
    assert runs["retry"].extra["applied while it failed"] == 0 and runs["retry"].report.violations == 0
    assert runs["dead-letter"].extra["applied while it failed"] == behind
    assert (runs["dead-letter"].report.violations, runs["dead-letter"].report.wrong_final) == (1, 1)
    parked_key_later = sum(1 for e in EVENTS[bad.n + 1 :] if e.key == bad.key)
    assert runs["park"].extra["applied while it failed"] == behind - parked_key_later
    assert runs["park"].report.violations == 0 and runs["park"].report.wrong_final == 0
    assert all(r.report.missing == 0 and r.report.duplicates == 0 for r in runs.values())


def test_a_pinned_client_gets_every_message_of_its_priority_group(no_nats_url: None) -> None:
    pinned = run(lambda shop: pk.pinned_group(shop.js), workers=0)
    assert pinned["policy"] == "pinned_client"
    assert pinned["A"] == ["e0", "e1", "e2", "e3"] and pinned["B"] == ["status 408", "status 408"]


def test_the_pin_moves_to_b_while_a_holds_an_unacked_event_unless_max_ack_pending_is_1(no_nats_url: None) -> None:
    async def experiment(shop: pk.Shop) -> tuple[dict[str, Any], dict[str, Any]]:
        return await pk.pin_takeover(shop.js), await pk.pin_takeover(shop.js, max_ack_pending=1)

    default, one = run(experiment, workers=0)
    assert default["A holds, unacked"] == one["A holds, unacked"] == "e0"
    assert default["B's first event"] == "e1"  # after priority_timeout: A's e0 and B's e1 in flight at once
    assert one["B's first event"] == "e0 (delivery 2)"  # only after ack_wait, A's event again, first


def test_two_tokens_are_hashed_joined_with_no_separator_so_ab_c_and_a_bc_collide(no_nats_url: None) -> None:
    keys = ["ab.c", "a.bc"] + [f"o-{i}.c-{i % 7}" for i in range(40)]
    stored = run(lambda shop: pk.two_token_partitions(shop.js, keys), workers=0)
    assert set(stored) == set(keys) and stored["ab.c"] == stored["a.bc"]
    assert all(p == oe.partition(key.replace(".", ""), 5) for key, p in stored.items())


def test_a_mappings_block_in_the_server_config_partitions_what_streams_store_too() -> None:
    keys = [f"o-{i}" for i in range(30)]
    seen = asyncio.run(pk.server_mappings(keys))
    assert seen["stored by the stream on part.>"] == seen["of them on part.<partition(key)>.<key>"] == len(keys)


def test_pythons_hash_differs_between_processes() -> None:
    keys = [f"o-{i}" for i in range(24)]
    one, other = pk.hash_in_processes(keys, 4)
    assert len(one) == len(other) == 24 and one != other  # equal by chance: (1/4)**24


def test_close_kills_the_workers_and_removes_the_lesson_streams(no_nats_url: None) -> None:
    from nats.js.errors import NotFoundError

    from msglab.broker import connect

    async def main() -> list[Any]:
        shop = await pk.Shop.open(workers=2)
        procs = [w.proc for w in shop.workers]
        await shop.close()
        nc = await connect()
        js = nc.jetstream()
        gone = []
        for name in pk.STREAMS:
            try:
                await js.stream_info(name)
            except NotFoundError:
                gone.append(name)
        await nc.close()
        assert gone == list(pk.STREAMS)
        return [p.returncode for p in procs]

    assert all(code is not None for code in asyncio.run(main()))
