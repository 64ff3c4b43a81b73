"""The course's payment gateway, as its own process on a real server: keys dedup charges inside the
window, a missing key charges every time, a key reused with other parameters is refused, a request
whose key is still in flight gets a conflict instead of a charge, search finds charges by reference
once they have propagated, and the test clock lets keys expire."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from msglab.broker.server import EmbeddedServer
from msglab.world import gateway as gw


@pytest.fixture
def gateway(server: EmbeddedServer, tmp_path: Path) -> Iterator[gw.Gateway]:
    with gw.start(server.url, db_path=str(tmp_path / "gateway.sqlite"), prefix="t.gateway", window=3600) as running:
        yield running


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_nc(url: str, body: Any) -> Any:
    nc = await nats.connect(url)
    try:
        return await body(nc)
    finally:
        await nc.close()


def test_same_key_inside_window_returns_the_first_charge(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        first = await gw.charge(nc, gateway.subject, "acct-1", 1250, reference="p-1", idempotency_key="p-1")
        again = await gw.charge(nc, gateway.subject, "acct-1", 1250, reference="p-1", idempotency_key="p-1")
        return first, again

    first, again = _run(_with_nc(server.url, body))
    assert (first["replayed"], again["replayed"]) == (False, True)
    assert again["charge_id"] == first["charge_id"]
    assert [c.charge_id for c in gateway.charges("p-1")] == [first["charge_id"]]
    assert [r.replayed for r in gateway.requests()] == [False, True]
    assert {r.idempotency_key for r in gateway.requests()} == {"p-1"}


def test_without_a_key_every_request_is_a_new_charge(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        return [await gw.charge(nc, gateway.subject, "acct-2", 900, reference="p-2") for _ in range(3)]

    replies = _run(_with_nc(server.url, body))
    assert len({r["charge_id"] for r in replies}) == 3
    assert len(gateway.charges("p-2")) == 3
    assert all(c.idempotency_key is None for c in gateway.charges("p-2"))


def test_concurrent_requests_with_one_key_charge_once(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        def one():
            return gw.charge(nc, gateway.subject, "acct-3", 500, reference="p-3", idempotency_key="k-3")

        return await asyncio.gather(*(one() for _ in range(8)))

    replies = _run(_with_nc(server.url, body))
    assert len({r["charge_id"] for r in replies}) == 1
    assert sum(not r["replayed"] for r in replies) == 1
    assert len(gateway.charges("p-3")) == 1


@pytest.mark.parametrize(
    ("account", "cents", "reference"),
    [("acct-1", 999, "p-7"), ("acct-2", 1250, "p-7"), ("acct-1", 1250, "p-8")],
    ids=["other amount", "other account", "other reference"],
)
def test_a_key_reused_with_other_parameters_is_refused(
    server: EmbeddedServer, gateway: gw.Gateway, account: str, cents: int, reference: str
) -> None:
    async def body(nc):
        first = await gw.charge(nc, gateway.subject, "acct-1", 1250, reference="p-7", idempotency_key="k-7")
        with pytest.raises(gw.IdempotencyKeyReused) as refused:
            await gw.charge(nc, gateway.subject, account, cents, reference=reference, idempotency_key="k-7")
        again = await gw.charge(nc, gateway.subject, "acct-1", 1250, reference="p-7", idempotency_key="k-7")
        return first, refused.value, again

    first, refused, again = _run(_with_nc(server.url, body))
    assert (refused.status, refused.code) == (400, "idempotency_key_reused")
    assert "k-7" in str(refused) and "other parameters" in str(refused)
    assert again["replayed"] and again["charge_id"] == first["charge_id"]  # the key still answers its own request
    assert [c.charge_id for c in gateway.charges()] == [first["charge_id"]]  # and nothing else was charged
    assert [r.outcome for r in gateway.requests()] == ["charged", "reused", "replayed"]


def test_a_request_whose_key_is_in_flight_gets_a_conflict_not_a_charge(server: EmbeddedServer, tmp_path: Path) -> None:
    slow = gw.start(server.url, db_path=str(tmp_path / "slow.sqlite"), prefix="t.slow", latency=1.5)

    def in_flight() -> bool:
        return bool(slow._read("select 1 from idempotency_keys where key = 'k-9' and charge_id is null"))

    async def body(nc):
        first = asyncio.ensure_future(
            gw.charge(nc, slow.subject, "acct-9", 4200, reference="p-9", idempotency_key="k-9", timeout=10)
        )
        while not in_flight():  # the first request has taken the key and is at the card network
            assert not first.done(), first.result()
            await asyncio.sleep(0.005)
        with pytest.raises(gw.IdempotencyKeyInUse) as conflict:
            await gw.charge(nc, slow.subject, "acct-9", 4200, reference="p-9", idempotency_key="k-9")
        charged = await first
        retry = await gw.charge(nc, slow.subject, "acct-9", 4200, reference="p-9", idempotency_key="k-9")
        return conflict.value, charged, retry

    with slow:
        conflict, charged, retry = _run(_with_nc(server.url, body))
    assert (conflict.status, conflict.code) == (409, "idempotency_key_in_use")
    assert "still being processed" in str(conflict)
    assert not charged["replayed"]
    assert retry["replayed"] and retry["charge_id"] == charged["charge_id"]
    assert [c.charge_id for c in slow.charges("p-9")] == [charged["charge_id"]]


def test_search_finds_charges_by_reference_once_they_have_propagated(
    server: EmbeddedServer, gateway: gw.Gateway
) -> None:
    async def body(nc):
        made = await gw.charge(nc, gateway.subject, "acct-5", 300, reference="p-5", idempotency_key="p-5")
        other = await gw.charge(nc, gateway.subject, "acct-5", 700, reference="p-6")
        at_once = await gw.search(nc, gateway.search_subject, "p-5")
        await gateway.advance(nc, seconds=gw.DEFAULT_SEARCH_LAG + 1)
        later = await gateway.search(nc, "p-5")
        await gateway.advance(nc, hours=2)  # past the 1 h key window: the key is gone, the charge is not
        after_window = await gw.search(nc, gateway.search_subject, "p-5")
        nothing = await gw.search(nc, gateway.search_subject, "p-404")
        return made, other, at_once, later, after_window, nothing

    made, other, at_once, later, after_window, nothing = _run(_with_nc(server.url, body))
    assert at_once == []  # a moment after the charge, search does not show it yet
    assert [c["charge_id"] for c in later] == [made["charge_id"]]
    assert later[0]["cents"] == 300 and later[0]["reference"] == "p-5"
    assert [c["charge_id"] for c in after_window] == [made["charge_id"]]
    assert nothing == [] and other["charge_id"] not in {c["charge_id"] for c in later}
    assert [r.outcome for r in gateway.requests("search")] == ["found 0", "found 1", "found 1", "found 0"]


def test_key_expires_after_the_window_on_the_test_clock(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        first = await gw.charge(nc, gateway.subject, "acct-4", 700, reference="p-4", idempotency_key="p-4")
        offset = await gateway.advance(nc, hours=0.5)
        inside = await gw.charge(nc, gateway.subject, "acct-4", 700, reference="p-4", idempotency_key="p-4")
        await gateway.advance(nc, hours=0.6)  # 1.1 h in all: past the 1 h window
        after = await gw.charge(nc, gateway.subject, "acct-4", 700, reference="p-4", idempotency_key="p-4")
        again = await gw.charge(nc, gateway.subject, "acct-4", 700, reference="p-4", idempotency_key="p-4")
        return first, offset, inside, after, again

    first, offset, inside, after, again = _run(_with_nc(server.url, body))
    assert offset == pytest.approx(1800)
    assert inside["charge_id"] == first["charge_id"]
    assert not after["replayed"] and after["charge_id"] != first["charge_id"]  # the key was forgotten
    assert again["replayed"] and again["charge_id"] == after["charge_id"]  # and is remembered anew
    assert len(gateway.charges("p-4")) == 2
    assert after["created"] - first["created"] == pytest.approx(1.1 * 3600, abs=60)  # on the gateway's clock


def test_bad_request_gets_an_error_reply_and_the_gateway_stays_up(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        reply = await nc.request(gateway.subject, b"not json", timeout=2)
        with pytest.raises(gw.GatewayError, match="bad search request"):
            await gw.search(nc, gateway.search_subject, None)  # type: ignore[arg-type]
        good = await gw.charge(nc, gateway.subject, "acct-5", 100, idempotency_key="k-5")
        return reply, good

    reply, good = _run(_with_nc(server.url, body))
    assert b"bad charge request" in reply.data
    assert good["cents"] == 100 and gateway.alive


def test_a_payment_message_can_be_sent_as_it_is(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        payment = b'{"payment_id": "p-11", "account": "acct-1", "cents": 800}'
        reply = await nc.request(gateway.subject, payment, timeout=2, headers={gw.KEY_HEADER: "p-11"})
        return reply.data

    data = _run(_with_nc(server.url, body))
    assert b'"reference": "p-11"' in data
    assert [c.reference for c in gateway.charges()] == ["p-11"]


def test_stop_ends_the_process_and_keeps_the_store(server: EmbeddedServer, tmp_path: Path) -> None:
    running = gw.start(server.url, db_path=str(tmp_path / "g.sqlite"), prefix="t.stop")
    running.stop()
    assert not running.alive
    assert running.charges() == []
    assert "stopped" in repr(running)


def test_attached_gateway_serves_the_same_contract_in_process(server: EmbeddedServer, tmp_path: Path) -> None:
    async def body() -> tuple[Any, Any, Any, Any]:
        host = await nats.connect(server.url)
        client = await nats.connect(server.url)
        try:
            served = await gw.attach(host, str(tmp_path / "attached.sqlite"), prefix="t.attached", window=60)
            first = await gw.charge(client, served.subject, "acct-6", 300, reference="p-6", idempotency_key="p-6")
            again = await gw.charge(client, served.subject, "acct-6", 300, reference="p-6", idempotency_key="p-6")
            await served.advance(client, seconds=gw.DEFAULT_SEARCH_LAG)
            found = await gw.search(client, served.search_subject, "p-6")
            await served.stop()
            return served, first, again, found
        finally:
            await client.close()
            await host.close()

    served, first, again, found = _run(body())
    assert again["replayed"] and again["charge_id"] == first["charge_id"]
    assert [c.charge_id for c in served.charges("p-6")] == [first["charge_id"]]
    assert [c["charge_id"] for c in found] == [first["charge_id"]]
