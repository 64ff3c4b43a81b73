"""Module 07's relay: publishes the shop's outbox (msglab.world.outbox) to JetStream, in order, and resumes.

    relay = Relay(db, js)
    await relay.step()       # publish every unsent row once; returns how many
    await relay.run()        # step for ever, asking the database again every `poll` s when idle

For each row, oldest first: publish it with `Nats-Msg-Id` = the outbox id, wait for the stream's ack,
then save the row's id as the relay's position in the same database. A relay that dies between the
ack and the save publishes that row again when it restarts: inside the stream's duplicate window the
stream drops it (the PubAck says `duplicate`), after it the stream stores it twice, and the consumer's
dedup table must take over. `sent` lists what this relay published and what the stream answered.

This relay is a poller: it asks the database for new rows. Change-data capture reads the database's
log instead; either may resend after a crash, for the same reason.

`hook(point, row)` is called at "published" (the stream has acked the row, its position is not saved):
a lesson's or grader's process makes it the place where the run may SIGKILL it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msglab.world.outbox import RELAY, Row, pending, position, save_position

MSG_ID = "Nats-Msg-Id"
POLL = 0.02  # seconds between two looks at an idle outbox (a poller's delay; CDC would be told instead)


@dataclass(frozen=True)
class Sent:
    """One publish the relay made and the stream's answer: its sequence, and whether it was a duplicate."""

    outbox_id: int
    seq: int
    duplicate: bool


@dataclass
class Relay:
    """Publishes outbox rows in order; its position lives in the shop's database, saved after each ack."""

    db: sqlite3.Connection
    js: Any
    name: str = RELAY
    batch: int = 100
    poll: float = POLL
    hook: Callable[[str, Row], Any] | None = None
    subject: Callable[[str], str] = str  # maps a row's subject to the one to publish on (a run's names)
    sent: list[Sent] = field(default_factory=list)

    @property
    def position(self) -> int:
        """The last outbox id saved as published."""
        return position(self.db, self.name)

    async def publish(self, row: Row) -> Sent:
        """Publish one row and wait for the stream's ack; its position is not saved yet."""
        ack = await self.js.publish(
            self.subject(row.subject), row.payload, headers={**row.headers, MSG_ID: str(row.id)}
        )
        sent = Sent(row.id, int(ack.seq), bool(ack.duplicate))
        self.sent.append(sent)
        return sent

    async def step(self) -> int:
        """Publish every row after the saved position, each acked and then saved; return how many."""
        done = 0
        while rows := pending(self.db, self.position, self.batch):
            for row in rows:
                await self.publish(row)
                if self.hook is not None:
                    self.hook("published", row)
                save_position(self.db, row.id, self.name)
                done += 1
        return done

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Relay for ever (or until `stop` is set)."""
        while stop is None or not stop.is_set():
            if not await self.step():
                await asyncio.sleep(self.poll)  # a poller's wait for new rows
