"""The course's payment gateway, as its own process on a real server: keys dedup charges inside the
window, a missing key charges every time, concurrent requests with one key charge once, and the
test clock lets a key expire."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from msglab.world import gateway as gw
from msglab.broker.server import EmbeddedServer


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


def test_bad_request_gets_an_error_reply_and_the_gateway_stays_up(server: EmbeddedServer, gateway: gw.Gateway) -> None:
    async def body(nc):
        reply = await nc.request(gateway.subject, b"not json", timeout=2)
        good = await gw.charge(nc, gateway.subject, "acct-5", 100, idempotency_key="k-5")
        return reply, good

    reply, good = _run(_with_nc(server.url, body))
    assert b"bad charge request" in reply.data
    assert good["cents"] == 100 and gateway.alive


def test_stop_ends_the_process_and_keeps_the_store(server: EmbeddedServer, tmp_path: Path) -> None:
    running = gw.start(server.url, db_path=str(tmp_path / "g.sqlite"), prefix="t.stop")
    running.stop()
    assert not running.alive
    assert running.charges() == []
    assert "stopped" in repr(running)


def test_attached_gateway_serves_the_same_contract_in_process(server: EmbeddedServer, tmp_path: Path) -> None:
    async def body() -> tuple[Any, Any, Any]:
        host = await nats.connect(server.url)
        client = await nats.connect(server.url)
        try:
            served = await gw.attach(host, str(tmp_path / "attached.sqlite"), prefix="t.attached", window=60)
            first = await gw.charge(client, served.subject, "acct-6", 300, reference="p-6", idempotency_key="p-6")
            again = await gw.charge(client, served.subject, "acct-6", 300, reference="p-6", idempotency_key="p-6")
            await served.stop()
            return served, first, again
        finally:
            await client.close()
            await host.close()

    served, first, again = _run(body())
    assert again["replayed"] and again["charge_id"] == first["charge_id"]
    assert [c.charge_id for c in served.charges("p-6")] == [first["charge_id"]]
