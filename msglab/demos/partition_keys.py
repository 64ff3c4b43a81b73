"""Lesson 06's plumbing: order events on a stream the server partitions by key, worker processes, the ledger.

    shop = await partition_keys.Shop.open()       # stream LESSON06_ORDERS, four idle worker processes
    run = await shop.shared(events, workers=2)    # two workers on one durable: run.report.violations
    run = await shop.partitioned(events, n=4)     # one durable per partition, one worker each
    await shop.close()

Events are published to `lesson06.orders.<key>`; the stream's subject transform (applied by the
server, nats-server 2.10 or later) stores each one as `lesson06.part.<p>.<key>` with
p = `{{partition(n,1)}}`, so every publisher's event of a key lands in the same partition. A durable per
partition filters `lesson06.part.<p>.>`.

The workers are `python -m msglab.demos.partition_keys` processes, idle until told which durable to
pull from: each fetches one event at a time, spends the event's work time on it, asks the ledger
(`msglab.world.order_events`, served in the lesson's own process) to record it, then acks. The
poison-event experiment runs its one consumer in the lesson's process, so its strategy is plain code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msglab.notebook.demo_process import DemoProcess
from msglab.world.order_events import Event, Ledger, Report, apply, serve

STREAM = "LESSON06_ORDERS"  # lesson06.orders.<key>, stored as lesson06.part.<p>.<key>
ASIDE = "LESSON06_ASIDE"  # the dead-letter queue and the parked events of section 5
STREAMS = (STREAM, ASIDE, "LESSON06_PINNED")
INTAKE = "lesson06.orders.*"
LEDGER = "lesson06.ledger.apply"
ACK_WAIT = 2.0  # seconds; long enough that no event is redelivered in these runs unless a worker dies
SHORT_ACK_WAIT = 0.5  # seconds: how soon the broker redelivers what a killed or stalled worker held


def transform(n: int) -> Any:
    """The stream's subject transform for n partitions: the server computes the partition from the key."""
    from nats.js.api import SubjectTransform

    return SubjectTransform(src=INTAKE, dest=f"lesson06.part.{{{{partition({n},1)}}}}.{{{{wildcard(1)}}}}")


# --- the worker processes ----------------------------------------------------------------------------


class Worker(DemoProcess):
    """One worker process, idle until `bind` names a durable; `unbind` stops it after its current event."""

    def __init__(self, proc: Any, name: str = "") -> None:
        super().__init__(proc)
        self.name = name
        self.durable: str | None = None

    @classmethod
    async def start(cls, name: str) -> Worker:
        from msglab.broker import server_url

        config = {"url": server_url(), "stream": STREAM, "name": name, "ledger": LEDGER}
        worker: Worker = await cls.spawn("msglab.demos.partition_keys", config)
        worker.name = name
        return worker

    async def bind(self, durable: str | None, hold: Event | None = None, stall: float = 0.0) -> None:
        """Pull from `durable` (None: stop pulling); returns once the process has taken it. With `hold`, the
        worker stops when it fetches that event and says "holding" (`until_said`): with no `stall` it keeps
        it unacked, telling the broker it is still on it, until it is killed; with `stall` it goes quiet for
        that many seconds, then applies and acks it and says "done"."""
        await self.say({"durable": durable, "hold": [hold.key, hold.seq] if hold else None, "stall": stall})
        await self.expect("ok")
        self.durable = durable

    async def until_said(self, what: str, timeout: float = 30) -> None:
        """Return once the worker says `what` ("holding", "done")."""
        await self.expect(what, timeout)

    def __repr__(self) -> str:
        return f"<Worker {self.name} pid {self.proc.pid}>"


async def _worker_main(config: dict[str, Any]) -> None:
    """The worker process: one pull loop on the durable it is told, one event at a time."""
    import nats

    from msglab.broker import tls_options

    nc = await nats.connect(config["url"], name=f"lesson06-{config['name']}", **tls_options(config["url"]))
    js = nc.jetstream()
    state: dict[str, Any] = {"task": None, "stop": False}

    async def loop(durable: str, hold: list[Any] | None, stall: float) -> None:
        sub = await js.pull_subscribe_bind(durable, config["stream"])
        try:
            while not state["stop"]:
                try:
                    msgs = await sub.fetch(1, timeout=0.2)
                except TimeoutError:
                    continue
                for msg in msgs:
                    held = time.monotonic()
                    event = Event.from_bytes(msg.data)
                    stalled = hold == [event.key, event.seq] and stall > 0
                    if hold == [event.key, event.seq]:
                        print("holding", flush=True)
                        # in_progress() resets ack_wait: the event stays ours until the lesson kills us.
                        while not stall:
                            await msg.in_progress()
                            await asyncio.sleep(0.1)
                        await asyncio.sleep(stall)  # quiet, not dead: ack_wait runs out meanwhile
                    await asyncio.sleep(event.work)
                    await apply(nc, config["ledger"], event, config["name"], held=time.monotonic() - held)
                    await msg.ack_sync()
                    if stalled:
                        print("done", flush=True)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        command = json.loads(line)
        durable = command["durable"]
        if state["task"] is not None:  # finish the event in hand, then stop
            state["stop"] = True
            await state["task"]
            state["task"], state["stop"] = None, False
        if durable:
            state["task"] = asyncio.ensure_future(loop(durable, command.get("hold"), command.get("stall", 0.0)))
        print("ok", flush=True)
    await nc.close()


# --- runs ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One experiment: the ledger's report, events applied per second, and what else it measured."""

    report: Report
    rate: float = 0.0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        more = "".join(f"; {k}: {v}" for k, v in self.extra.items())
        return f"{self.report!r}; {self.rate:.0f} events/s{more}"


class Shop:
    """The lesson's stream, its durables, the ledger and four worker processes."""

    def __init__(self, nc: Any, js: Any, workers: list[Worker], ledger: Ledger, ledger_sub: Any) -> None:
        self.nc = nc
        self.js = js
        self.workers = workers
        self.ledger = ledger
        self._ledger_sub = ledger_sub
        self.durables: list[str] = []
        self.n = 1

    @classmethod
    async def open(cls, workers: int = 4) -> Shop:
        """A fresh stream LESSON06_ORDERS with one partition, the ledger, `workers` idle worker processes."""
        from msglab.broker import connect, delete_stream

        nc = await connect(name="lesson06-shop")
        version = nc.connected_server_version
        if (version.major, version.minor) < (2, 10):  # subject transforms on streams came in 2.10
            from msglab.broker import masked, server_url
            from msglab.errors import ServerError

            await nc.close()
            raise ServerError(
                f"lesson 06 needs nats-server 2.10 or later (a stream's subject transform partitions the events); "
                f"the server at {masked(server_url())} is {version}",
                hint="unset NATS_URL to use the course's own server (2.15.1), or upgrade yours",
            )
        js = nc.jetstream()
        for name in STREAMS:
            await delete_stream(js, name)  # in case an earlier run stopped halfway
        await js.add_stream(name=STREAM, subjects=[INTAKE], subject_transform=transform(1))
        await js.add_stream(name=ASIDE, subjects=["lesson06.dlq.>", "lesson06.parked.>"])
        ledger = Ledger()
        sub = await serve(nc, LEDGER, ledger)
        pool = await asyncio.gather(*(Worker.start(f"w{i + 1}") for i in range(workers)))
        return cls(nc, js, list(pool), ledger, sub)

    async def repartition(self, n: int) -> None:
        """Change the stream's subject transform to n partitions (stored events keep their subjects)."""
        info = await self.js.stream_info(STREAM)
        config = info.config
        config.subject_transform = transform(n)
        await self.js.update_stream(config)
        self.n = n

    async def durable(self, name: str, subject: str, **config: Any) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        config.setdefault("ack_wait", ACK_WAIT)
        await self.js.add_consumer(
            STREAM, ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, **config)
        )
        self.durables.append(name)

    async def reset(self, n: int = 1) -> None:
        """Idle every worker, delete the durables, empty the stream and the ledger, n partitions."""
        for w in self.workers:
            if w.durable:
                await w.bind(None)
        for name in self.durables:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(STREAM, name)
        self.durables = []
        await self.js.purge_stream(STREAM)
        await self.js.purge_stream(ASIDE)
        await self.repartition(n)
        self.ledger.clear()

    async def publish(self, events: Sequence[Event]) -> None:
        """Publish each event to lesson06.orders.<key>, each confirmed by the stream."""
        for e in events:
            await self.js.publish(f"lesson06.orders.{e.key}", e.to_bytes())

    async def _until(self, condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        give_up = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > give_up:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            await asyncio.sleep(0.01)

    async def until_applied(self, count: int, timeout: float = 60.0) -> None:
        """Wait until the ledger holds `count` distinct events (a loaded machine is slow, not wrong)."""
        give_up = time.monotonic() + timeout
        while self.ledger.distinct() < count:
            if time.monotonic() > give_up:
                raise TimeoutError(f"only {self.ledger.distinct()} of {count} events applied in {timeout:.0f} s")
            await asyncio.sleep(0.01)

    async def _drain(self, events: Sequence[Event], bindings: Sequence[tuple[Worker, str]]) -> Run:
        """Publish `events` as a backlog, then bind the workers and time until all are applied."""
        self.ledger.expected = list(events)
        await self.publish(events)
        t0 = time.monotonic()
        for w, durable in bindings:
            await w.bind(durable)
        await self.until_applied(len(events))
        seconds = time.monotonic() - t0
        for w, _ in bindings:
            await w.bind(None)
        return Run(self.ledger.report(), rate=len(events) / seconds, seconds=seconds)

    # -- section 1 and 2: one durable, several workers; one durable, one event at a time

    async def shared(self, events: Sequence[Event], workers: int = 2, max_ack_pending: int = 1000,
                     kill: bool = False, stall: float = 0.0) -> Run:  # fmt: skip
        """`workers` worker processes share one durable on every partition.

        With `kill`, the first worker takes the first event and holds it until the others have applied
        that order's later events, or at once if the durable hands them nothing meanwhile
        (max_ack_pending=1); then it is SIGKILLed, and the broker redelivers the event after ack_wait.
        While it holds the event it calls in_progress(), so that what the run shows is the kill's
        redelivery, not ack_wait running out under a live worker (that is `stall`).
        With `stall` (seconds, longer than ack_wait), the first worker goes quiet that long on the first
        event, no in_progress(), then applies and acks it: the broker has meanwhile handed it to another."""
        await self.reset()
        short = kill or stall > 0
        await self.durable("all", "lesson06.part.>", max_ack_pending=max_ack_pending,
                           ack_wait=SHORT_ACK_WAIT if short else ACK_WAIT)  # fmt: skip
        if not short:
            return await self._drain(events, [(w, "all") for w in self.workers[:workers]])
        self.ledger.expected = list(events)
        await self.publish(events)
        t0 = time.monotonic()
        victim, first = self.workers[0], events[0]
        await victim.bind("all", hold=first, stall=stall)
        await victim.until_said("holding")
        for w in self.workers[1:workers]:
            await w.bind("all")
        if stall:
            await self.until_applied(len(events))
            await victim.until_said("done", timeout=stall + 30)  # its late apply is in the ledger
        else:
            later = {(e.key, e.seq) for e in events if e.key == first.key and e.seq > first.seq}
            if max_ack_pending > 1:
                await self._until(
                    lambda: later <= {(a.key, a.seq) for a in self.ledger.log}, "the order's later events"
                )
            victim.kill()  # a real SIGKILL, the first event unacked in its hands
            await victim.close()
            await self.until_applied(len(events))
        seconds = time.monotonic() - t0
        for w in self.workers[int(not stall) : workers]:
            await w.bind(None)
        if not stall:
            self.workers[0] = await Worker.start(victim.name)  # the pool is whole again for the next run
        run = Run(self.ledger.report(), rate=len(events) / seconds, seconds=seconds)
        run.extra["stalled on" if stall else "killed holding"] = f"{first.key} {first.kind}"
        mine = [a for a in self.ledger.log if a.key == first.key]
        if stall:
            run.extra[f"{first.key}'s events applied (event, worker)"] = [(a.kind, a.worker) for a in mine]
        else:
            run.extra[f"{first.key}'s events applied in the order"] = [a.seq for a in mine]
        return run

    async def runs_out(self, events: Sequence[Event], max_deliver: int = 2) -> list[str]:
        """The first event's order alone on a durable with max_ack_pending=1 and `max_deliver`; a consumer
        (in this process) naks that first event every time and acks the rest: what it is handed, in turn."""
        await self.reset(1)
        first = events[0]
        mine = [e for e in events if e.key == first.key]
        await self.durable("p0", "lesson06.part.0.>", max_ack_pending=1, max_deliver=max_deliver)
        await self.publish(mine)
        sub = await self.js.pull_subscribe_bind("p0", STREAM)
        handed: list[str] = []
        while len(handed) < max_deliver + len(mine) - 1:
            for msg in await sub.fetch(1, timeout=10):
                event = Event.from_bytes(msg.data)
                handed.append(f"{event.kind} #{msg.metadata.num_delivered}")
                await (msg.nak() if event == first else msg.ack_sync())
        await sub.unsubscribe()
        return handed

    # -- section 3: partition by key

    async def partitioned(self, events: Sequence[Event], n: int) -> Run:
        """n partitions, one durable each, one worker process each."""
        await self.reset(n)
        for p in range(n):
            await self.durable(f"p{p}", f"lesson06.part.{p}.>")
        run = await self._drain(events, [(self.workers[p], f"p{p}") for p in range(n)])
        stored = (await self.js.stream_info(STREAM, subjects_filter="lesson06.part.>")).state.subjects or {}
        run.extra["stored per partition"] = [
            sum(c for s, c in stored.items() if s.split(".")[2] == str(p)) for p in range(n)
        ]
        run.extra["server's partition per key"] = {s.split(".")[3]: int(s.split(".")[2]) for s in stored}
        return run

    # -- section 4: n to n + 1 partitions while events keep coming

    async def rescale(self, events: Sequence[Event], n: int, *, drain_first: bool, before: float = 0.6) -> Run:
        """n partitions with a worker each take the first `before` of the events as a backlog; then the
        stream goes to n + 1 partitions, a new worker takes the new one, and the rest are published.
        With drain_first, publishing waits (the producer holds its events) until the old durables
        have nothing pending or unacked."""
        await self.reset(n)
        for p in range(n):
            await self.durable(f"p{p}", f"lesson06.part.{p}.>")
        self.ledger.expected = list(events)
        cut = int(len(events) * before)
        await self.publish(events[:cut])
        t0 = time.monotonic()
        for p in range(n):
            await self.workers[p].bind(f"p{p}")
        waited = 0.0
        if drain_first:
            t1 = time.monotonic()
            await self.until_applied(cut)  # every event the old partitions hold is applied (and acked next)
            await self._until_acked([f"p{p}" for p in range(n)])
            waited = time.monotonic() - t1
        await self.repartition(n + 1)
        await self.durable(f"p{n}", f"lesson06.part.{n}.>")
        await self.workers[n].bind(f"p{n}")
        await self.publish(events[cut:])
        await self.until_applied(len(events))
        seconds = time.monotonic() - t0
        for w in self.workers[: n + 1]:
            await w.bind(None)
        run = Run(self.ledger.report(), rate=len(events) / seconds, seconds=seconds)
        first, rest = {e.key for e in events[:cut]}, {e.key for e in events[cut:]}
        from msglab.world.order_events import partition

        both = sorted(first & rest)
        run.extra["keys with events on both sides"] = len(both)
        run.extra["moved"] = {k: f"p{partition(k, n)} -> p{partition(k, n + 1)}" for k in both
                              if partition(k, n) != partition(k, n + 1)}  # fmt: skip
        if drain_first:
            run.extra["publishing paused"] = f"{waited:.2f} s"
        return run

    async def _until_acked(self, durables: Sequence[str], timeout: float = 30.0) -> None:
        give_up = time.monotonic() + timeout
        for name in durables:
            while True:
                info = await self.js.consumer_info(STREAM, name)
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                if time.monotonic() > give_up:
                    raise TimeoutError(f"durable {name} did not drain in {timeout:.0f} s")
                await asyncio.sleep(0.01)

    # -- section 5: a poison event in a partition

    async def poison(self, events: Sequence[Event], bad: Event, strategy: str, tries: int = 5) -> Run:
        """One partition, one consumer (in this process, one event at a time); applying `bad` fails until it
        is resolved. strategy "retry": nak and try again; "dead-letter": set it aside on
        lesson06.dlq.<key> and go on; "park": set it and every later event of its key aside on
        lesson06.parked.<key>, go on with other keys. Resolved (the failure fixed, what was set aside
        replayed in order) once it failed `tries` times and nothing else can go on."""
        await self.reset(1)
        await self.durable("p0", "lesson06.part.0.>", max_ack_pending=1)
        self.ledger.expected = list(events)
        await self.publish(events)
        sub = await self.js.pull_subscribe_bind("p0", STREAM)
        broken, failures, parked = True, 0, set()
        applied_while_broken = 0
        behind = len(events) - 1 - events.index(bad)

        def handle(event: Event) -> None:
            nonlocal applied_while_broken
            if broken and event == bad:
                raise RuntimeError("the payment record for this order is malformed")
            self.ledger.apply(event, "consumer")
            applied_while_broken += broken and failures > 0

        async def resolve() -> None:
            nonlocal broken
            broken = False
            if strategy in ("dead-letter", "park"):
                aside = await self.js.pull_subscribe(f"lesson06.*.{bad.key}", stream=ASIDE)
                try:
                    for msg in await aside.fetch(100, timeout=1):
                        handle(Event.from_bytes(msg.data))
                        await msg.ack_sync()
                except TimeoutError:
                    pass
                await aside.unsubscribe()
                parked.discard(bad.key)

        while self.ledger.distinct() < len(events):
            try:
                msgs = await sub.fetch(1, timeout=0.2)
            except TimeoutError:
                msgs = []
            for msg in msgs:
                event = Event.from_bytes(msg.data)
                if event.key in parked:
                    await self.js.publish(f"lesson06.parked.{event.key}", msg.data)  # waits behind the failed one
                    await msg.ack_sync()
                    continue
                try:
                    handle(event)
                    await msg.ack_sync()
                except RuntimeError:
                    failures += 1
                    if strategy == "retry":
                        await msg.nak()
                    elif strategy == "dead-letter":
                        await self.js.publish(f"lesson06.dlq.{event.key}", msg.data)
                        await msg.term()
                    else:
                        parked.add(event.key)
                        await self.js.publish(f"lesson06.parked.{event.key}", msg.data)
                        await msg.ack_sync()
            if not broken or not failures:
                continue
            # Resolved once retrying has had its tries, or once nothing but what was set aside is left.
            if failures >= tries or (not msgs and (await self.js.consumer_info(STREAM, "p0")).num_pending == 0):
                await resolve()
        await sub.unsubscribe()
        run = Run(self.ledger.report())
        run.extra["events behind the poison"] = behind
        run.extra["applied while it failed"] = applied_while_broken
        return run

    async def close(self) -> None:
        """Stop every worker process, delete the lesson's streams, close the connection."""
        from msglab.broker import delete_stream

        for w in self.workers:
            await w.close()
        with contextlib.suppress(Exception):
            await self._ledger_sub.unsubscribe()
        for name in STREAMS:
            await delete_stream(self.js, name)
        await self.nc.close()


# --- what else the lesson checks on the server ------------------------------------------------------


PINNED = "LESSON06_PINNED"  # priority groups: stream lesson06pin.>, durable "group", group "workers"
PRIORITY_TIMEOUT = 0.5  # seconds a pinned client may stop pulling before the pin moves
PINNED_ACK_WAIT = 1.5  # seconds; longer than PRIORITY_TIMEOUT, so the two are told apart


async def _pinned_durable(js: Any, **config: Any) -> str:
    """A fresh stream with events e0-e5 and a durable with the pinned_client policy, through the raw
    JetStream API (nats-py 2.16 has no call for priority groups); returns the policy the server took."""
    from msglab.broker import delete_stream

    await delete_stream(js, PINNED)
    await js.add_stream(name=PINNED, subjects=["lesson06pin.>"])
    config = {"durable_name": "group", "ack_policy": "explicit", "priority_groups": ["workers"],
              "priority_policy": "pinned_client", **config}  # fmt: skip
    create = json.dumps({"stream_name": PINNED, "config": config}).encode()
    made = json.loads((await js._nc.request(f"$JS.API.CONSUMER.CREATE.{PINNED}.group", create)).data)
    for i in range(6):
        await js.publish(f"lesson06pin.{i}", f"e{i}".encode())
    return str(made.get("config", {}).get("priority_policy", made.get("error")))


async def _pull(nc: Any, inbox: Any, batch: int, pin: str | None, ack: bool = True) -> tuple[list[str], str | None]:
    """One pull of up to `batch` events in the group, expiring after 0.2 s; what came (an event, with its
    delivery count if redelivered, or the status that ended the pull) and the pin id the server gave."""
    ask = {"batch": batch, "expires": 200_000_000, "group": "workers", **({"id": pin} if pin else {})}
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{PINNED}.group", json.dumps(ask).encode(), reply=inbox.subject)
    got: list[str] = []
    for _ in range(batch):
        try:
            msg = await inbox.next_msg(2)
        except TimeoutError:
            break
        status = (msg.headers or {}).get("Status")
        if status:
            got.append(f"status {status}")
            break
        pin = msg.headers.get("Nats-Pin-Id", pin)  # the pinned client names itself in its next pulls
        delivered = msg.metadata.num_delivered
        got.append(msg.data.decode() + (f" (delivery {delivered})" if delivered > 1 else ""))
        if ack:
            await msg.respond(b"+ACK")
    return got, pin


async def pinned_group(js: Any) -> dict[str, Any]:
    """Two clients, A then B, take turns pulling up to two events each from a pinned_client durable."""
    from msglab.broker import delete_stream

    nc = js._nc
    policy = await _pinned_durable(js, priority_timeout=int(PRIORITY_TIMEOUT * 1e9))
    got: dict[str, list[str]] = {"A": [], "B": []}
    pins: dict[str, str | None] = {"A": None, "B": None}
    inboxes = {who: await nc.subscribe(nc.new_inbox()) for who in got}
    for who in ("A", "B", "A", "B"):
        events, pins[who] = await _pull(nc, inboxes[who], 2, pins[who])
        got[who] += events
    for sub in inboxes.values():
        await sub.unsubscribe()
    await delete_stream(js, PINNED)
    return {"policy": policy, **got}


async def pin_takeover(js: Any, max_ack_pending: int = 1000) -> dict[str, Any]:
    """A, pinned, takes e0 and goes quiet without acking it (stalled or dead: the broker cannot tell);
    B pulls until it gets an event. Which event, and how long after A's last pull."""
    from msglab.broker import delete_stream

    nc = js._nc
    await _pinned_durable(js, priority_timeout=int(PRIORITY_TIMEOUT * 1e9), ack_wait=int(PINNED_ACK_WAIT * 1e9),
                          max_ack_pending=max_ack_pending)  # fmt: skip
    a, b = await nc.subscribe(nc.new_inbox()), await nc.subscribe(nc.new_inbox())
    held, _ = await _pull(nc, a, 1, None, ack=False)
    quiet = time.monotonic()
    got: list[str] = []
    while not got and time.monotonic() - quiet < 30:
        events, _ = await _pull(nc, b, 1, None)
        got = [e for e in events if not e.startswith("status")]
    after = time.monotonic() - quiet
    await a.unsubscribe()
    await b.unsubscribe()
    await delete_stream(js, PINNED)
    return {"A holds, unacked": held[0], "B's first event": got[0] if got else "none", "after": f"{after:.1f} s"}


async def two_token_partitions(js: Any, keys: Sequence[str], n: int = 5) -> dict[str, int]:
    """Where a stream transform `{{partition(n,1,2)}}` stores each two-token key ("ab.c"): key -> partition."""
    from nats.js.api import SubjectTransform

    from msglab.broker import delete_stream

    name = "LESSON06_TOKENS"
    await delete_stream(js, name)
    dest = f"lesson06tok.{{{{partition({n},1,2)}}}}.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}"
    await js.add_stream(name=name, subjects=["lesson06two.*.*"],
                        subject_transform=SubjectTransform(src="lesson06two.*.*", dest=dest))  # fmt: skip
    try:
        for key in keys:
            await js.publish(f"lesson06two.{key}", b"")
        stored = (await js.stream_info(name, subjects_filter=">")).state.subjects or {}
        return {".".join(s.split(".")[2:]): int(s.split(".")[1]) for s in stored}
    finally:
        await delete_stream(js, name)


async def server_mappings(keys: Sequence[str], n: int = 3) -> dict[str, Any]:
    """A server of its own whose config maps `in.*` to `part.{{partition(n,1)}}.<key>` for the whole
    account: does a stream on `part.>` store what is published to `in.<key>`, where partition() puts it?"""
    import tempfile

    import nats

    from msglab.broker.server import EmbeddedServer
    from msglab.world.order_events import partition

    with tempfile.TemporaryDirectory(prefix="msglab-lesson06-") as folder:
        conf = Path(folder) / "mappings.conf"
        conf.write_text(f'mappings = {{ "in.*": "part.{{{{partition({n},1)}}}}.{{{{wildcard(1)}}}}" }}\n')
        with EmbeddedServer(config=str(conf)) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                await js.add_stream(name="PARTS", subjects=["part.>"])
                for key in keys:
                    await js.publish(f"in.{key}", b"")
                stored = (await js.stream_info("PARTS", subjects_filter=">")).state.subjects or {}
            finally:
                await nc.close()
    where = sum(stored.get(f"part.{partition(k, n)}.{k}", 0) for k in keys)
    return {"published to in.<key>": len(keys), "stored by the stream on part.>": sum(stored.values()),
            "of them on part.<partition(key)>.<key>": where}  # fmt: skip


def hash_in_processes(keys: Sequence[str], n: int, processes: int = 2) -> list[list[int]]:
    """Python's built-in hash(key) % n for each key, computed in `processes` fresh interpreters (each
    with its own random salt, as by default: PYTHONHASHSEED unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    code = f"import json, sys; print(json.dumps([hash(k) % {n} for k in json.load(sys.stdin)]))"
    out = []
    for _ in range(processes):
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps(list(keys)), capture_output=True,
                              text=True, env=env, check=True)  # fmt: skip
        out.append(json.loads(done.stdout))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    asyncio.run(_worker_main(json.loads(args[0])))


if __name__ == "__main__":
    main()
