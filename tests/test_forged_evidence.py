"""The broker's evidence cannot be forged by a learner process: on a real nats-server with the run's
users, an ack, nak or in-progress counts only when it answers a delivery the server made. A learner
publishing on `$JS.ACK...` subjects it builds itself (the server ignores them), or faking a delivery
on its own inbox first, adds nothing to what the grader's BrokerWatch calls evidence."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from msglab.broker.server import EmbeddedServer
from msglab.broker.users import LEARNER_INBOX, RunUsers
from msglab.grading.observe import BrokerWatch

STREAM, DURABLE, SUBJECT = "EMAILS", "email", "orders.email"


@pytest.fixture
def urls() -> Iterator[tuple[str, str]]:
    """A run's own server with its grader and learner users (as the harness makes them)."""
    users = RunUsers(None)
    folder = tempfile.mkdtemp(prefix="msglab-forged-test-")
    config = os.path.join(folder, "server.conf")
    Path(config).write_text(users.config())
    with EmbeddedServer(config=config) as server:
        yield users.grader_url(server.url), users.learner_url(server.url)
    os.unlink(config)
    os.rmdir(folder)


class _Watch(BrokerWatch):
    """A BrokerWatch that says when it heard the genuine final ack."""

    acked_once: asyncio.Event

    async def _on_ack(self, msg: Any) -> None:
        await super()._on_ack(msg)
        self._heard()

    async def _on_delivery(self, msg: Any) -> None:  # its own subscription: it may come after the ack
        await super()._on_delivery(msg)
        self._heard()

    def _heard(self) -> None:
        if any(a.kind == "ack" for a in self.acks):
            self.acked_once.set()


async def _forge_and_watch(grader_url: str, learner_url: str) -> tuple[BrokerWatch, str]:
    grader = await nats.connect(grader_url)
    js = grader.jetstream()
    await js.add_stream(name=STREAM, subjects=["orders.>"])
    await js.add_consumer(
        STREAM, ConsumerConfig(durable_name=DURABLE, filter_subject=SUBJECT, ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    )
    for order in ("o-1", "o-2"):
        await js.publish(SUBJECT, order.encode())
    watch = _Watch(STREAM, DURABLE)
    watch.acked_once = asyncio.Event()
    await watch.start(grader, inboxes=[LEARNER_INBOX])
    learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX, allow_reconnect=False)
    sub = await learner.jetstream().pull_subscribe(SUBJECT, durable=DURABLE, stream=STREAM)
    [held] = await sub.fetch(1, timeout=5)  # o-1, stream seq 1: the one real delivery
    await held.in_progress()  # genuine: the server acts on it
    real = held.reply
    tokens = real.split(".")
    # Forged: o-2 (seq 2) was never delivered; a made-up subject for it, a malformed one, and a
    # fake "delivery" of seq 2 on the learner's own inbox first, so a naive watch would believe it.
    fake = ".".join([*tokens[:4], "1", "2", "7", tokens[7], "0"])
    await learner.publish(f"{LEARNER_INBOX}.forged.1", b"o-2", reply=fake)
    await learner.publish(fake, b"+WPI")
    await learner.publish(fake, b"+ACK")
    await learner.publish(f"$JS.ACK.{STREAM}.{DURABLE}.1.2.x", b"+WPI")
    await learner.publish(".".join([*tokens[:5], "9", *tokens[6:]]), b"+WPI")  # a sequence it never held
    await learner.flush()
    await held.nak(delay=0.2)  # genuine, with the delay the grader reads
    [second] = await sub.fetch(1, timeout=5)  # o-2: the server ignored the forged ack, so it is still to deliver
    await second.ack()  # genuine, and the last: once the grader has it, it has everything before it
    await asyncio.wait_for(watch.acked_once.wait(), 10)
    await watch.stop()
    await learner.close()
    await grader.close()
    return watch, real


def test_forged_acks_and_in_progress_are_not_evidence(urls: tuple[str, str]) -> None:
    watch, real = asyncio.run(_forge_and_watch(*urls))
    seen = [(a.kind, a.stream_seq, a.delivered) for a in watch.acks]
    assert seen == [("progress", 1, 1), ("nak", 1, 1), ("ack", 2, 1)], seen
    assert watch.acks[1].delay == pytest.approx(0.2)
    assert next(iter(watch.deliveries)) == real and len(watch.deliveries) == 2  # the fake one is not one
    assert [a.kind for a in watch.of(2)] == ["ack"]  # only the real one
    forged = [(a.kind, a.stream_seq) for acks in watch.unmatched.values() for a in acks]
    assert ("progress", 2) in forged and ("ack", 2) in forged and ("progress", 9) in forged
