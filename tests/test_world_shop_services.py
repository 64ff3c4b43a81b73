"""Module 07's shop services, each a process of its own on a real server: payments charges each order once
(a SIGKILL between its charge and its ack is redelivered and replayed at the gateway, never charged again),
fails an order over the card limit into its DLQ, email retries a provider outage and dead-letters a receipt
that can never go out, and the status page's GET /orders ends right, each hop carrying the Correlation-Id."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from msglab.broker.server import EmbeddedServer
from msglab.world import email_provider as ep
from msglab.world import gateway as gw
from msglab.world import shop_services as ss

PLACED, STATUS, DLQ, EMAIL_DLQ = "t.orders.placed", "t.orders.status", "t.orders.payments.dlq", "t.orders.email.dlq"
HELD = "t.services.held"


async def _until(condition: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            got = condition()
            if await got if isinstance(got, Awaitable) else got:
                return
            await asyncio.sleep(0.02)


class World:
    """One server's streams and durables, the gateway and the provider (attached here), and the services."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url, self.folder = url, folder
        self.services: list[ss.Service] = []

    async def __aenter__(self) -> World:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await self._clean()  # the server is shared by the module's tests: each starts from empty streams
        await self.js.add_stream(name="ORDERS", subjects=[PLACED])
        await self.js.add_stream(name="STATUS", subjects=[f"{STATUS}.>"])
        await self.js.add_stream(name="DLQ", subjects=[DLQ, EMAIL_DLQ])
        for stream, durable, subject, budget in (
            ("ORDERS", "payments", PLACED, None),
            ("STATUS", "email", f"{STATUS}.>", ss.MAX_DELIVER),
        ):
            config = ConsumerConfig(
                durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=0.5,
                max_deliver=budget,
            )  # fmt: skip
            await self.js.add_consumer(stream, config)
        self.gateway = await gw.attach(self.nc, str(self.folder / "gateway.sqlite"), prefix="t.gateway")
        self.provider = await ep.attach(self.nc, str(self.folder / "provider.sqlite"), prefix="t.provider")
        self.provider.behaviour.control("template", name=ss.TEMPLATES["failed"], known=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for service in self.services:
            await asyncio.to_thread(service.stop)
        await self.gateway.stop()
        await self.provider.stop()
        await self._clean()
        await self.nc.close()

    async def _clean(self) -> None:
        from nats.js.errors import NotFoundError

        for stream in ("ORDERS", "STATUS", "DLQ"):
            with contextlib.suppress(NotFoundError):
                await self.js.delete_stream(stream)

    async def start(self, service: str, **options: Any) -> ss.Service:
        defaults: dict[str, dict[str, Any]] = {
            "payments": {
                "stream": "ORDERS", "durable": "payments", "gateway": self.gateway.subject, "status": STATUS,
                "dlq": DLQ, "key": "seq",
            },
            "email": {
                "stream": "STATUS", "durable": "email", "provider": self.provider.subject, "dlq": EMAIL_DLQ,
                "backoff": [0.1, 0.2, 0.4, 0.8],
            },
            "status": {"subject": f"{STATUS}.>", "stream": "STATUS"},
        }  # fmt: skip
        running = await asyncio.to_thread(ss.start, service, self.url, **{**defaults[service], **options})
        self.services.append(running)
        return running

    async def place(self, order_id: str, cents: int, customer: str = "c-1") -> None:
        body = json.dumps({"id": order_id, "customer": customer, "cents": cents}).encode()
        await self.js.publish(PLACED, body, headers={"Correlation-Id": f"trace-{order_id}"})

    async def dead(self, subject: str) -> list[Any]:
        from nats.js.errors import NotFoundError

        found: list[Any] = []
        seq = 1
        while True:
            try:
                msg = await self.js.get_msg("DLQ", seq, subject=subject, next=True)
            except NotFoundError:
                return found
            found.append(msg)
            seq = int(msg.seq or 0) + 1


def _run(server: EmbeddedServer, tmp_path: Path, body: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        async with World(server.url, tmp_path) as world:
            await body(world)

    asyncio.run(main())


def test_each_service_is_a_process_and_the_page_ends_right_for_every_order(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body(w: World) -> None:
        page, pay, mail = await asyncio.gather(w.start("status"), w.start("payments"), w.start("email"))
        assert len({page.pid, pay.pid, mail.pid}) == 3 and all(s.alive for s in (page, pay, mail))
        await w.place("o-1", 1200)
        await w.place("o-2", ss.CARD_LIMIT + 100)  # over the card limit: failed for good
        await w.place("o-3", 900, customer="c-3")
        await _until(lambda: len(page.orders()) == 3 and "pending" not in page.orders().values())
        assert page.orders() == {"o-1": "confirmed", "o-2": "failed", "o-3": "confirmed"}
        assert sorted(c.reference or "" for c in w.gateway.charges()) == ["o-1", "o-3"]  # o-2 never charged
        dead = await w.dead(DLQ)
        assert [json.loads(m.data)["id"] for m in dead] == ["o-2"]
        assert dead[0].headers["Correlation-Id"] == "trace-o-2" and "card limit" in dead[0].headers["Dlq-Reason"]
        await _until(lambda: len(w.provider.sent()) == 3)
        sent = {e.order_id: (e.to, e.template) for e in w.provider.sent()}
        assert sent == {
            "o-1": ("c-1@example.com", "order_confirmation"),
            "o-2": ("c-1@example.com", "payment_failed"),
            "o-3": ("c-3@example.com", "order_confirmation"),
        }
        # The receipt, an effect outside the broker, keeps its order's correlation id at the provider too.
        assert {e.order_id: e.correlation_id for e in w.provider.sent()} == {o: f"trace-{o}" for o in sent}
        info = await w.js.stream_info("STATUS")
        for seq in range(1, info.state.last_seq + 1):  # every status carries its order's id
            msg: Any = await w.js.get_msg("STATUS", seq)
            assert msg.headers["Correlation-Id"] == f"trace-{json.loads(msg.data)['id']}"

    _run(server, tmp_path, body)


def test_a_payments_process_sigkilled_between_charge_and_ack_is_not_charged_again(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body(w: World) -> None:
        held: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_held(msg: Any) -> None:
            held.put_nowait(json.loads(msg.data))

        await w.nc.subscribe(HELD, cb=on_held)
        await w.nc.flush()
        first = await w.start("payments", hold_after=2, announce=HELD)
        for n in (1, 2, 3):
            await w.place(f"o-{n}", 100 * n)
        said = await asyncio.wait_for(held.get(), 10)
        assert said["pid"] == first.pid and said["order"] == "o-2" and said["num_delivered"] == 1
        info = await w.js.consumer_info("ORDERS", "payments")
        assert info.num_ack_pending >= 1  # it holds o-2's delivery, charged and not acked
        await asyncio.to_thread(first.kill)
        assert not first.alive
        await w.start("payments")
        await _until(lambda: len(w.gateway.charges()) == 3)
        await _until(async_acked(w, 3))
        assert sorted(c.reference or "" for c in w.gateway.charges()) == ["o-1", "o-2", "o-3"]
        replays = [r for r in w.gateway.requests() if r.replayed]
        assert [r.reference for r in replays] == ["o-2"]  # the redelivery got the first charge back

    _run(server, tmp_path, body)


def async_acked(w: World, count: int) -> Callable[[], Awaitable[bool]]:
    async def acked() -> bool:
        info = await w.js.consumer_info("ORDERS", "payments")
        return int(info.ack_floor.stream_seq) >= count and info.num_ack_pending == 0

    return acked


async def _status(w: World, order_id: str, state: str, customer: str) -> None:
    body = json.dumps({"id": order_id, "status": state, "customer": customer}).encode()
    await w.js.publish(f"{STATUS}.{order_id}", body, headers={"Correlation-Id": f"trace-{order_id}"})


def test_an_email_outage_is_retried_with_growing_waits_then_the_receipt_is_sent_once(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body(w: World) -> None:
        await w.provider.outage(w.nc, 0.5, from_next_request=True)
        await w.start("email")
        await _status(w, "o-7", "pending", "c-7")
        await _status(w, "o-7", "confirmed", "c-7")
        await _until(lambda: any(r.status == 200 for r in w.provider.requests("o-7")))
        asked = w.provider.requests("o-7")
        assert len(w.provider.sent()) == 1
        assert [r.status for r in asked][:2] == [503, 503] and asked[-1].status == 200
        gaps = [b.ts - a.ts for a, b in itertools.pairwise(asked)]
        assert all(gap >= 0.9 * wait for gap, wait in zip(gaps, [0.1, 0.2, 0.4, 0.8], strict=False))  # waits grow
        assert not await w.dead(EMAIL_DLQ)

    _run(server, tmp_path, body)


def test_a_receipt_that_can_never_be_sent_is_dead_lettered_with_its_correlation_id(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body(w: World) -> None:
        w.provider.behaviour.control("mailbox", address="c-9@example.com", exists=False)  # 422, every time
        await w.start("email")
        await _status(w, "o-9", "confirmed", "c-9")
        await _until(lambda: len(w.provider.requests("o-9")) >= 1)
        dead: list[Any] = []

        async def dead_lettered() -> bool:
            dead[:] = await w.dead(EMAIL_DLQ)
            return bool(dead)

        await _until(dead_lettered)
        assert len(w.provider.requests("o-9")) == 1  # a 422 is not retried
        assert dead[0].headers["Correlation-Id"] == "trace-o-9" and "422" in dead[0].headers["Dlq-Reason"]
        assert not w.provider.sent()

    _run(server, tmp_path, body)


def test_a_page_started_after_the_statuses_shows_them_read_back_from_the_stream(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    async def body(w: World) -> None:
        await _status(w, "o-4", "pending", "c-4")
        await _status(w, "o-4", "confirmed", "c-4")
        await _status(w, "o-5", "failed", "c-5")
        await _status(w, "o-5", "pending", "c-5")  # late: a final status is never set back
        page = await w.start("status")
        assert page.orders() == {"o-4": "confirmed", "o-5": "failed"}  # read back before it said ready

    _run(server, tmp_path, body)
