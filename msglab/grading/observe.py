"""What the grader sees on the broker itself, from its own connection, out of the learner's reach.

`BrokerWatch` receives copies of every ack a durable gets (`$JS.ACK.<stream>.<durable>.>`) and
every pull request its workers send (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`): core NATS
delivers them to the grader's subscription as well as to the server. So a grader knows which
stream sequence was acked when, whichever client API or batching the learner used, and how long
a worker's fetch waits (its `expires`), without asking the learner's process anything.

An ack counts only if the server acted on it: its subject must be the reply subject of a delivery
the server made. A learner process can publish on `$JS.ACK...` subjects it builds itself (the
server ignores one that names no delivery), so the watch also takes a copy of every delivery to
the learner's inboxes and keeps an ack-family message only when it answers one of them; the rest
are kept apart in `unmatched`, never as evidence (an ack handled before its delivery waits there
until the delivery's copy comes: each subscription's callbacks run in a task of their own). A
delivery is told from a learner's publish on its own inbox by its subject: the server sends it
under the stream's subject, a publish on an inbox carries the inbox's.

`refuse_publishes` makes a stream reject publishes for a while (a full stream with discard-new),
so a grader can check that "accepted" means the stream confirmed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

ACK_KINDS = {b"": "ack", b"+ACK": "ack", b"-NAK": "nak", b"+WPI": "progress", b"+TERM": "term", b"+NXT": "ack"}


@dataclass(frozen=True)
class Ack:
    """One ack-family message a worker sent for a delivery."""

    ts: float  # the grader's clock
    kind: str  # ack, nak, progress, term
    stream_seq: int
    delivered: int  # which delivery of that message it answers (1 = the first)
    delay: float | None = None  # a nak's requested redelivery delay in seconds, when it gave one


@dataclass(frozen=True)
class Pull:
    """One pull request a worker sent."""

    ts: float
    batch: int
    expires: float  # seconds the request may wait (0: none given)
    no_wait: bool
    inbox: str = ""  # the reply inbox: one per pull subscription (or connection), so it tells workers apart
    durable: str = ""  # the durable it asked (a watch of durable '*' sees every one's)


CATCH_UP_LIMIT = 2.0  # seconds caught_up waits for a subscription's queue (its callbacks never block)
UNMATCHED_KEPT = 10_000  # ack-family messages naming no delivery kept for a verdict (a flood is bounded)


async def caught_up(nc: Any, subs: list[Any]) -> None:
    """Return once every message the server routed to `nc` before now has been handed to its callback: a
    PONG follows whatever the server sent before it, then each subscription's queue is worked off (as
    nats-py's own drain() does), at most CATCH_UP_LIMIT seconds each."""
    await nc.flush()
    for sub in subs:
        queue = getattr(sub, "_pending_queue", None)  # nats-py's; its drain() joins it the same way
        if queue is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queue.join(), CATCH_UP_LIMIT)


_PROCESS = re.compile(r"w[0-9]+")  # the token a run adds to the learner's inbox prefix for each process (harness)


def _delivery_of(subject: str) -> tuple[int, int] | None:
    """(which delivery, stream seq) named by an ack subject, or None for another subject:
    $JS.ACK.<stream>.<durable>.<delivered>.<sseq>.<dseq>.<ts>.<pending> (v1), or with domain and account hash (v2)."""
    tokens = subject.split(".")
    at = 4 if len(tokens) == 9 else 6
    try:
        return int(tokens[at]), int(tokens[at + 1])
    except (IndexError, ValueError):
        return None


@dataclass
class BrokerWatch:
    """Acks and pull requests of one durable, as the grader's own connection sees them."""

    stream: str
    durable: str
    acks: list[Ack] = field(default_factory=list)  # only acks that answer a delivery the server made
    pulls: list[Pull] = field(default_factory=list)
    deliveries: dict[str, float] = field(default_factory=dict)  # reply subject -> when the server sent it
    unmatched: dict[str, list[Ack]] = field(default_factory=dict)  # by subject: naming no delivery (yet)
    _subs: list[Any] = field(default_factory=list)
    _inboxes: tuple[str, ...] = ()
    _nc: Any = None
    _unmatched_count: int = 0

    async def start(self, nc: Any, inboxes: list[str] | None = None) -> BrokerWatch:
        """Subscribe on `nc`; `inboxes` are the learner's inbox prefixes (default: what the run's
        connection names in `msglab_inboxes`, set by harness.Run, else the learner user's and nats-py's)."""
        from msglab.broker import settle_subscriptions
        from msglab.broker.users import LEARNER_INBOX

        named = inboxes or getattr(nc, "msglab_inboxes", None) or [LEARNER_INBOX, "_INBOX"]
        prefixes = list(dict.fromkeys(named))
        self._nc = nc
        self._inboxes = tuple(prefix + "." for prefix in prefixes)
        self._subs = [
            *[await nc.subscribe(f"{prefix}.>", cb=self._on_delivery) for prefix in prefixes],
            await nc.subscribe(f"$JS.ACK.{self.stream}.{self.durable}.>", cb=self._on_ack),
            await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}", cb=self._on_pull),
        ]
        await settle_subscriptions(nc)
        return self

    async def caught_up(self) -> None:
        """Return once every copy the server routed to the grader before now is in the watch.

        A PING on the grader's connection returns after everything the server sent it before the PING,
        and each subscription then hands its messages to a task of its own: wait until each queue is
        worked off (as nats-py's own drain() does). So an ack the server had before a learner's effect
        call is in the watch, stamped earlier than that call, when the grader calls this first; without
        it, the order of the two stamps is the order two sockets happened to be read in.
        """
        if self._nc is not None:
            await caught_up(self._nc, list(self._subs))

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _ours(self, subject: str) -> bool:
        """An ack subject of this watch's stream and durable (the durable may be '*': every one)."""
        tokens = subject.split(".")
        at = 2 if len(tokens) == 9 else 4  # v1, or v2 with domain and account hash
        return (
            len(tokens) in (9, 11, 12)
            and tokens[:2] == ["$JS", "ACK"]
            and tokens[at] == self.stream
            and self.durable in ("*", tokens[at + 1])
        )

    async def _on_delivery(self, msg: Any) -> None:
        reply, subject = msg.reply or "", msg.subject or ""
        # The server's delivery carries the stream's subject; a publish on an inbox carries the inbox.
        if not self._ours(reply) or subject.startswith(self._inboxes) or reply in self.deliveries:
            return
        self.deliveries[reply] = time.time()
        # Its ack may have been handled first: nats-py runs each subscription's callbacks in a task of its own.
        early = self.unmatched.pop(reply, None)
        if early:
            self.acks = sorted([*self.acks, *early], key=lambda ack: ack.ts)

    async def _on_ack(self, msg: Any) -> None:
        counted = _delivery_of(msg.subject)
        if counted is None:
            return
        delivered, seq = counted
        head, _, rest = msg.data.partition(b" ")
        kind, delay = ACK_KINDS.get(head, "other"), None
        if kind == "nak" and rest.strip():
            with contextlib.suppress(ValueError, TypeError, AttributeError, OverflowError):
                delay = float(json.loads(rest).get("delay", 0)) / 1e9
        ack = Ack(time.time(), kind, seq, delivered, delay)
        if msg.subject in self.deliveries:
            self.acks.append(ack)
        elif self._unmatched_count < UNMATCHED_KEPT:
            # No delivery had this reply subject: the server ignores it, and so does the grader.
            self._unmatched_count += 1
            self.unmatched.setdefault(msg.subject, []).append(ack)

    async def _on_pull(self, msg: Any) -> None:
        try:
            request = json.loads(msg.data or b"{}")
        except ValueError:
            request = {}
        if isinstance(request, int) and not isinstance(request, bool):  # a bare batch size is a valid request too
            request = {"batch": request}
        if not isinstance(request, dict):
            request = {}
        reply = msg.reply or ""
        # The inbox a pull's reply names: nats-py's is <prefix>.<token> per pull subscription (per connection for
        # its request mux, <prefix>.<token>.<n>), where a run's prefix is the learner's plus one token per process.
        tokens = reply.split(".")
        inbox = ".".join(tokens[: 3 if len(tokens) > 2 and _PROCESS.fullmatch(tokens[1]) else 2])
        first = reply.split(".")[0]
        if first and self._nc is not None and not reply.startswith(self._inboxes) and len(self._inboxes) < 8:
            # A worker with an inbox of its own choosing: its deliveries are watched from now on.
            self._inboxes += (first + ".",)
            self._subs.append(await self._nc.subscribe(f"{first}.>", cb=self._on_delivery))
        try:
            batch, expires = int(request.get("batch", 1)), float(request.get("expires", 0)) / 1e9
        except (TypeError, ValueError, OverflowError):
            return  # the server refuses a malformed request too
        durable = (msg.subject or "").rsplit(".", 1)[-1]
        self.pulls.append(Pull(time.time(), batch, expires, bool(request.get("no_wait")), inbox, durable))

    def acked(self, stream_seq: int, before: float | None = None) -> Ack | None:
        """The first ack of that message (before a time, if given), or None."""
        for ack in self.acks:
            if ack.stream_seq == stream_seq and ack.kind == "ack" and (before is None or ack.ts <= before):
                return ack
        return None

    def of(self, stream_seq: int) -> list[Ack]:
        """Every ack-family message sent for that stream sequence, in order."""
        return [a for a in self.acks if a.stream_seq == stream_seq]

    def sent(self, stream_seq: int) -> list[tuple[int, float]]:
        """Every delivery the server made of that stream sequence: (which delivery, when), in order."""
        counted = [(_delivery_of(reply), ts) for reply, ts in self.deliveries.items()]
        return sorted(((c[0], ts) for c, ts in counted if c and c[1] == stream_seq), key=lambda d: d[1])

    def refetched_after_idle(self, since: float) -> Pull | None:
        """A pull request sent by the same connection after an earlier one (sent after `since`) had
        waited out its `expires` with nothing acked in between.

        Seeing one proves that worker survived an empty fetch and asked again.
        """
        # nats-py sends an empty fetch as no_wait requests with an expires and waits that long itself.
        waiting = [p for p in self.pulls if p.ts >= since and p.expires > 0]
        for first in waiting:
            for later in self.pulls:
                if later.inbox != first.inbox or later.ts < first.ts + first.expires * 0.95 or later.ts <= first.ts:
                    continue
                if any(first.ts < ack.ts < later.ts for ack in self.acks):
                    break  # a message arrived in between: that fetch was not empty
                return later
        return None


@contextlib.asynccontextmanager
async def refuse_publishes(js: Any, stream: str) -> AsyncIterator[None]:
    """While inside, the stream rejects every publish (full, discard-new: err_code 10077)."""
    from nats.js.api import DiscardPolicy

    info = await js.stream_info(stream)
    original = info.config
    full = dict(original.as_dict())
    # At its current size, by count and bytes (an empty stream: one byte), so the next publish does not fit.
    full.update(
        max_msgs=max(1, info.state.messages), max_bytes=max(1, info.state.bytes), discard=DiscardPolicy.NEW.value
    )
    from nats.js.api import StreamConfig

    await js.update_stream(StreamConfig.from_response(full))
    try:
        yield
    finally:
        await js.update_stream(original)
