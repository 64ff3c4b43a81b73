"""Small demo services the lessons run against the real server, each started and stopped in one line.

    Responder    a request-reply service on one subject that is up (answers), down (not
                 subscribed: the server tells a caller "no responders" at once) or silent
                 (subscribed but never answers: the caller waits for its timeout); the course's
                 one model of it, msglab.world.storefront's, which the lab's inventory and
                 loyalty are made of too
    Chain        three services calling each other with request-reply, orders -> inventory ->
                 payments; each fails each call it receives with a seeded random draw, so
                 thousands of calls over several seeds measure the chain's availability and its
                 spread in a few seconds
    EmailWorker  sends one email per order event it fetches from a durable consumer, acks after
    OrderDesk    the same orders placed two ways (wait for email, or publish an event), with the
                 inventory and email services taken up and down: the model behind lesson 01's
                 control panel
    DiskServer   a nats-server of the lesson's own whose store folder outlives the process, so it
                 can be stopped and started again on the same store
    EmailProcess an email worker in a real process of its own (`python -m` this module), which
                 the lesson SIGKILLs

The services in this kernel each open their own connection, and `close()` removes everything
they started; they are not processes of their own (EmailProcess is).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from msglab.broker import connect, delete_stream, settle_subscriptions, tls_options
from msglab.broker.server import EmbeddedServer, die_with_parent
from msglab.world.storefront import INVENTORY
from msglab.world.storefront import STATES as STATES  # the lesson reaches the storefront's through this module
from msglab.world.storefront import Responder as Responder

CHAIN = ("orders", "inventory", "payments")


def _why(exc: BaseException) -> str:
    """How a failed request looks to the caller, in the lesson's words."""
    import nats.errors

    return "no responders" if isinstance(exc, nats.errors.NoRespondersError) else "timed out"


@dataclass
class ChainRun:
    """What a batch of calls into the chain saw."""

    hops: int
    calls: int
    ok: int
    down_at: Counter[str]  # failed calls per service that was down ("timeout" if no answer came at all)
    latencies: list[float]  # seconds, one per call
    seconds: float  # wall time of the whole batch
    seed: int | None = None  # the seed of the services' random failures, when there were any

    @property
    def availability(self) -> float:
        """Share of calls that got a full answer."""
        return self.ok / self.calls

    @property
    def downtime(self) -> float:
        """Share of calls that failed."""
        return 1 - self.availability

    @property
    def median_ms(self) -> float:
        """Median latency of one call, in milliseconds."""
        return statistics.median(self.latencies) * 1000

    @property
    def failed(self) -> int:
        """How many calls failed."""
        return self.calls - self.ok

    def __repr__(self) -> str:
        return (
            f"<ChainRun {self.hops} hops: {self.ok}/{self.calls} ok ({self.availability:.4%}), "
            f"median {self.median_ms:.2f} ms, {self.calls / self.seconds:,.0f} calls/s>"
        )


class _Downtime:
    """Whether a service is down for each call it receives: one seeded random draw per call.

    Up 99.9 % means each call finds the service down with probability 0.001, independently of
    every other call: a thousand calls may see no failure, or three. The same seed and
    availability give the same draws, so a run can be replayed.
    """

    def __init__(self, availability: float, seed: str) -> None:
        self.availability = availability
        self.rng = random.Random(seed)

    def down(self) -> bool:
        """Whether the next call finds the service down."""
        return self.rng.random() >= self.availability


class Chain:
    """Three services that call each other with request-reply: orders -> inventory -> payments.

    A call with `hops=3` enters at orders and needs all three; `hops=1` asks payments alone.
    Each service fails each call it receives with probability 1 - availability, drawn from a
    seeded random stream of its own (see _Downtime): the failures are random, so a run of a few
    thousand calls shows the sampling noise too, and `spread` runs several seeds to show it. A
    down service answers an error at once, as a dead instance behind a load balancer would, and
    a failure anywhere fails the whole call. `work` seconds stand in for each service's own work
    (a database query, say).
    """

    def __init__(self, prefix: str, conns: list[Any]) -> None:
        self.prefix = prefix
        self.conns = conns
        self.availability = 1.0
        self.work = 0.0
        self.timeout = 5.0  # generous: a slow machine must not pass for a down service
        self._seed = 0
        self._downtime: dict[str, _Downtime] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Any] = []
        self.configure(seed=0)

    @classmethod
    async def start(
        cls,
        prefix: str = "lesson01.chain",
        *,
        availability: float = 1.0,
        work: float = 0.0,
        seed: int = 0,
        url: str | None = None,
    ) -> Chain:
        """Start the three services, each on its own connection."""
        conns = [await connect(url, name=f"msglab-chain-{name}") for name in CHAIN]
        chain = cls(prefix, conns)
        chain.configure(availability=availability, work=work, seed=seed)
        for index, nc in enumerate(conns):
            chain._subs.append(await nc.subscribe(chain.subject(CHAIN[index]), cb=chain._receiver(index)))
            await settle_subscriptions(nc)
        return chain

    def subject(self, name: str) -> str:
        """The subject a service listens on."""
        return f"{self.prefix}.{name}"

    def configure(
        self, *, availability: float | None = None, work: float | None = None, seed: int | None = None
    ) -> None:
        """Change availability per service, work per call, or the seed; the random draws start afresh.

        The same seed and availability give the same draws, run after run.
        """
        if availability is not None:
            self.availability = availability
        if work is not None:
            self.work = work
        if seed is not None:
            self._seed = seed
        self._downtime = {name: _Downtime(self.availability, f"{self._seed}:{name}") for name in CHAIN}

    def _receiver(self, index: int) -> Callable[[Any], Any]:
        async def on_request(msg: Any) -> None:
            # nats-py runs one callback at a time per subscription: serve each call in its own
            # task so a service handles many calls at once, as a real one would.
            task = asyncio.create_task(self._serve(index, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return on_request

    async def _serve(self, index: int, msg: Any) -> None:
        import nats.errors

        name = CHAIN[index]
        if self._downtime[name].down():
            await msg.respond(json.dumps({"ok": False, "down": name}).encode())
            return
        if self.work:
            await asyncio.sleep(self.work)  # the service's own work, simulated
        if index + 1 == len(CHAIN):
            await msg.respond(b'{"ok": true}')
            return
        try:
            reply = await self.conns[index].request(self.subject(CHAIN[index + 1]), msg.data, timeout=self.timeout)
            body = reply.data  # the callee's answer, success or failure, passed up the chain
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            body = json.dumps({"ok": False, "down": CHAIN[index + 1]}).encode()
        await msg.respond(body)

    async def call(self, nc: Any, hops: int = 3) -> tuple[str | None, float]:
        """One call through the last `hops` services; returns (the service that was down or None, seconds)."""
        import nats.errors

        entry = CHAIN[len(CHAIN) - hops]
        started = time.perf_counter()
        try:
            reply = await nc.request(self.subject(entry), b"{}", timeout=self.timeout)
            down = json.loads(reply.data).get("down")
        except nats.errors.NoRespondersError:
            down = entry  # the service is not running at all
        except nats.errors.TimeoutError:
            down = "timeout"
        return down, time.perf_counter() - started

    async def latency(self, nc: Any, calls: int = 200, hops: Sequence[int] = (1, 2, 3)) -> list[ChainRun]:
        """One call at a time through 1, 2 and 3 services, taking turns, so a busy machine slows all alike."""
        results: dict[int, list[tuple[str | None, float]]] = {h: [] for h in hops}
        started = time.perf_counter()
        for _ in range(calls):
            for h in hops:
                results[h].append(await self.call(nc, h))
        seconds = time.perf_counter() - started
        runs = []
        for h, got in results.items():
            down_at = Counter(down for down, _ in got if down)
            runs.append(ChainRun(h, calls, calls - sum(down_at.values()), down_at, [s for _, s in got], seconds))
        return runs

    async def run(self, nc: Any, calls: int, hops: int = 3, concurrency: int = 50) -> ChainRun:
        """Make `calls` calls, at most `concurrency` at a time, and count what came back."""
        if not 1 <= hops <= len(CHAIN):
            raise ValueError(f"hops must be 1 to {len(CHAIN)}")
        gate = asyncio.Semaphore(concurrency)

        async def one() -> tuple[str | None, float]:
            async with gate:
                return await self.call(nc, hops)

        started = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(calls)))
        seconds = time.perf_counter() - started
        down_at = Counter(down for down, _ in results if down)
        return ChainRun(
            hops, calls, calls - sum(down_at.values()), down_at, [s for _, s in results], seconds, self._seed
        )

    async def spread(
        self, nc: Any, *, availability: float, seeds: Sequence[int], calls: int, hops: Sequence[int] = (1, 3)
    ) -> list[ChainRun]:
        """For each seed, `calls` calls through each number of hops, every service up `availability`."""
        runs = []
        for seed in seeds:
            for h in hops:
                self.configure(availability=availability, seed=seed)
                runs.append(await self.run(nc, calls, hops=h))
        return runs

    async def close(self) -> None:
        """Stop the three services and close their connections; the next call sees nobody listening."""
        for index, nc in enumerate(self.conns):
            if nc.is_closed:
                continue
            if index < len(self._subs):
                # Unsubscribe first: the server may notice a closed connection only later.
                await self._subs[index].unsubscribe()
                await settle_subscriptions(nc)
            await nc.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class EmailWorker:
    """Sends one email per order event from a durable consumer, and acks each after its email.

    `up()` starts consuming, `down()` stops after the batch in hand (nothing is left half done),
    `emailed` counts emails per order id. The worker keeps its connection across up and down,
    like a process whose consumer loop is paused.
    """

    def __init__(self, stream: str, durable: str, *, url: str | None = None, batch: int = 50) -> None:
        self.stream = stream
        self.durable = durable
        self.url = url
        self.batch = batch
        self.emailed: Counter[str] = Counter()
        self._nc: Any = None
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._changed = asyncio.Condition()

    @property
    def running(self) -> bool:
        """Whether the worker is consuming."""
        return self._task is not None and not self._task.done()

    async def up(self) -> None:
        """Start consuming from the durable (a no-op if already running)."""
        if self.running:
            return
        if self._nc is None:
            self._nc = await connect(self.url, name=f"msglab-email-worker-{self.durable}")
            self._sub = await self._nc.jetstream().pull_subscribe_bind(self.durable, self.stream)
        self._stopping = False
        self._task = asyncio.create_task(self._loop())

    async def down(self) -> None:
        """Stop consuming once the batch in hand is emailed and acked."""
        self._stopping = True
        if self._task is not None:
            await self._task
            self._task = None

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                msgs = await self._sub.fetch(self.batch, timeout=0.2)
            except TimeoutError:  # nothing waiting: ask again (and notice a stop within 0.2 s)
                continue
            for msg in msgs:
                self.emailed[json.loads(msg.data)["id"]] += 1  # the email goes out...
                await msg.ack_sync()  # ...and only then the server hears it is done
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, order_ids: set[str], timeout: float = 5.0) -> None:
        """Return once every order in `order_ids` has been emailed; TimeoutError after `timeout`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: order_ids <= set(self.emailed)), timeout)

    async def close(self) -> None:
        """Stop and close the worker's connection (even if its loop had failed)."""
        try:
            await self.down()
        finally:
            if self._nc is not None and not self._nc.is_closed:
                await self._nc.close()


@dataclass
class Tally:
    """Everything the order desk has seen so far, per way of placing an order."""

    request_reply: Counter[str] = field(default_factory=Counter)  # outcome -> orders
    event: Counter[str] = field(default_factory=Counter)
    emailed: int = 0  # event-path orders emailed so far
    waiting: int = 0  # event-path orders stored in the stream, not yet emailed
    states: dict[str, str] = field(default_factory=dict)  # service -> up / down / silent

    def accepted(self, path: str) -> int:
        """Orders accepted on 'request_reply' or 'event'."""
        return getattr(self, path)["accepted"]

    def refused(self, path: str) -> int:
        """Orders refused on 'request_reply' or 'event'."""
        counts = getattr(self, path)
        return sum(counts.values()) - counts["accepted"]


class OrderDesk:
    """Place the same orders two ways while services are taken up and down.

    Both ways first ask inventory for stock (request-reply: the order needs that answer now).
    The request-reply way then asks the email service to send the confirmation and waits for
    "sent"; the event way publishes the order to a stream and returns, and an EmailWorker on a
    durable consumer sends the email whenever it is up.
    """

    def __init__(self, nc: Any, js: Any, prefix: str, stream: str, timeout: float) -> None:
        self.nc, self.js = nc, js
        self.prefix, self.stream, self.durable = prefix, stream, "desk_email"
        self.timeout = timeout
        self.services: dict[str, Responder] = {}
        self.worker: EmailWorker | None = None
        self.tally_so_far = Tally()
        self._event_ids: set[str] = set()
        self._next = 0

    @classmethod
    async def open(
        cls,
        nc: Any,
        js: Any,
        *,
        prefix: str = "lesson01.desk",
        stream: str = "LESSON01_DESK",
        timeout: float = 0.25,
        url: str | None = None,
    ) -> OrderDesk:
        """Create the desk's stream and durable, and start inventory, email and the email worker, all up.

        `timeout` is how long a request waits for inventory or email; `url` is the server the
        services connect to (the course's server by default: pass the one `nc` uses if not).
        """
        from nats.js.api import ConsumerConfig

        desk = cls(nc, js, prefix, stream, timeout)
        await delete_stream(js, stream)  # left over from an aborted run
        await js.add_stream(name=stream, subjects=[f"{prefix}.placed"])
        await js.add_consumer(stream, ConsumerConfig(durable_name=desk.durable, ack_wait=0.5))
        desk.services["inventory"] = await Responder.start(f"{prefix}.{INVENTORY}", b'{"reserved": true}', url=url)
        desk.services["email"] = await Responder.start(f"{prefix}.email.send", b"sent", url=url)
        desk.worker = EmailWorker(stream, desk.durable, url=url)
        await desk.worker.up()
        return desk

    async def set_state(self, service: str, state: str) -> None:
        """Take 'inventory' or 'email' up, down or silent (for the email worker, silent is down).

        Email coming up returns once its worker has caught up on what waited for it.
        """
        await self.services[service].set_state(state)
        if service == "email" and self.worker is not None and state == "up":
            await self.worker.up()
            await self.settle()
        elif service == "email" and self.worker is not None:
            await self.worker.down()

    async def _ask(self, service: str, order: dict[str, Any]) -> str | None:
        """Request-reply to a service; None on an answer, else why there was none."""
        import nats.errors

        try:
            await self.nc.request(self.services[service].subject, json.dumps(order).encode(), timeout=self.timeout)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            return f"{service}: {_why(exc)}"
        return None

    async def _place_request_reply(self, order: dict[str, Any]) -> str:
        return await self._ask("inventory", order) or await self._ask("email", order) or "accepted"

    async def _place_event(self, order: dict[str, Any]) -> str:
        refused = await self._ask("inventory", order)
        if refused:
            return refused
        await self.js.publish(f"{self.prefix}.placed", json.dumps(order).encode())
        self._event_ids.add(order["id"])
        return "accepted"

    async def fire(self, n: int) -> Tally:
        """Place n orders each way, all at once; wait for the emails if the worker is up; return the tally."""
        ids = range(self._next, self._next + n)
        self._next += n
        both = await asyncio.gather(
            asyncio.gather(*(self._place_request_reply({"id": f"r-{i}"}) for i in ids)),
            asyncio.gather(*(self._place_event({"id": f"e-{i}"}) for i in ids)),
        )
        self.tally_so_far.request_reply.update(both[0])
        self.tally_so_far.event.update(both[1])
        return await self.settle()

    async def settle(self, timeout: float = 5.0) -> Tally:
        """If the email worker is up, wait until it has emailed every accepted event; return the tally."""
        if self.worker is not None and self.worker.running:
            await self.worker.wait_for(set(self._event_ids), timeout)
        return await self.tally()

    async def tally(self) -> Tally:
        """What has happened so far: outcomes per way, emails sent, orders waiting in the stream."""
        tally = self.tally_so_far
        tally.emailed = len(set(self.worker.emailed) & self._event_ids) if self.worker else 0
        # Every accepted event is emailed or waiting: wait (briefly) until the consumer agrees.
        info = await wait_until_waiting(self.js, self.stream, self.durable, len(self._event_ids) - tally.emailed)
        tally.waiting = info.num_pending + info.num_ack_pending
        tally.states = {name: service.state for name, service in self.services.items()}
        return tally

    async def close(self) -> None:
        """Stop the services and the worker, and delete the desk's stream (its durable goes with it)."""
        try:
            if self.worker is not None:
                await self.worker.close()
        finally:
            for service in self.services.values():
                await service.close()
            await delete_stream(self.js, self.stream)


async def wait_until_waiting(js: Any, stream: str, durable: str, count: int, timeout: float = 2.0) -> Any:
    """Return the consumer's info once exactly `count` messages wait on it (not yet delivered, or not yet acked).

    A consumer learns of a new message a moment after the stream stored it, so right after a
    publish its count can fall short for a few milliseconds: ask again until it adds up, or
    until `timeout`, and return what the server said last either way.
    """
    deadline = time.monotonic() + timeout
    while True:
        info = await js.consumer_info(stream, durable)
        if info.num_pending + info.num_ack_pending == count or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.005)  # poll interval, bounded by the deadline above


def pooled_downtime(runs: Sequence[ChainRun], hops: int) -> float:
    """The share of failed calls over every run through `hops` services (every seed together)."""
    mine = [run for run in runs if run.hops == hops]
    return sum(run.failed for run in mine) / sum(run.calls for run in mine)


def nearest(value: float, options: dict[str, float]) -> str:
    """The option whose number is nearest to `value`, by ratio ('three times' is nearer 3.4 than 'twice')."""
    if value <= 0:
        return min(options, key=lambda name: abs(options[name] - value))
    return min(options, key=lambda name: abs(math.log(value / options[name])))


async def wait_until_stored(js: Any, stream: str, count: int, timeout: float = 2.0) -> int:
    """Return how many messages the stream holds once it is `count` (or what it holds at `timeout`).

    A stream with work-queue or interest retention removes an acked message a moment after the
    ack's reply, so right after the ack its count can still include it: ask again until it adds up.
    """
    deadline = time.monotonic() + timeout
    while True:
        held = int((await js.stream_info(stream)).state.messages)
        if held == count or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.005)  # poll interval, bounded by the deadline above


# --- durability: a server restarted on its store, a worker killed for real ---------------------------


class DiskServer:
    """A nats-server of the lesson's own whose store folder outlives the process.

    `restart()` stops the server (SIGTERM, as a deploy or a reboot would) and starts a new
    process on the same store folder and port; `js` is a JetStream context on it, reconnected
    after every restart. `close()` stops it and removes the store.
    """

    def __init__(self) -> None:
        self.store = tempfile.mkdtemp(prefix="msglab-lesson01-store-")
        atexit.register(shutil.rmtree, self.store, True)  # gone with the kernel, even if close() never runs
        self.server: EmbeddedServer | None = None
        self.port: int | None = None
        self.restarts = 0
        self.nc: Any = None
        self.js: Any = None

    @classmethod
    async def start(cls) -> DiskServer:
        """Start a server on a fresh store folder (a free port, kept across restarts)."""
        disk = cls()
        await disk._boot()
        return disk

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server else None

    async def _boot(self) -> None:
        # -sd and -p come after EmbeddedServer's own flags, and the last one wins.
        args = ["-sd", self.store] + (["-p", str(self.port)] if self.port else [])
        self.server = await asyncio.to_thread(EmbeddedServer(extra_args=args).start)
        self.port = self.server.port
        self.nc = await connect(self.server.url, name="msglab-lesson01-disk", max_reconnect_attempts=0)
        self.js = self.nc.jetstream()

    async def restart(self) -> None:
        """Stop the server process and start a new one on the same store folder and port."""
        await self._stop()
        self.restarts += 1
        await self._boot()

    async def _stop(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)  # removes only the server's own unused folder

    async def close(self) -> None:
        """Stop the server and remove its store."""
        await self._stop()
        shutil.rmtree(self.store, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<DiskServer pid {self.pid} at {self.server.url if self.server else '?'}, store {self.store}>"


class EmailProcess:
    """An email worker in a process of its own: fetch one order, email it, ack it; until killed.

    Each email is a line the process prints, read here into `emailed` as (order id, delivery
    number). With `hang_after=n` the process stands still right after its n-th email, before
    that email's ack, so that a kill lands between the two.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.emailed: list[tuple[str, int]] = []
        self._changed = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, url: str, stream: str, durable: str, *, hang_after: int = 0) -> EmailProcess:
        """Start the worker process on the server at `url`."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, "worker", url, stream, durable, str(hang_after),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=(lambda: die_with_parent(signal.SIGKILL)) if sys.platform.startswith("linux") else None,
        )  # fmt: skip
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            async with self._changed:
                self.emailed.append((event["emailed"], event["delivery"]))
                self._changed.notify_all()

    async def wait_emailed(self, count: int, timeout: float = 10.0) -> None:
        """Return once the process has sent `count` emails; TimeoutError after `timeout`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.emailed) >= count), timeout)

    async def kill(self) -> None:
        """SIGKILL the process: no ack, no goodbye, no cleanup."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        await self._reader

    def __repr__(self) -> str:
        state = "running" if self.proc.returncode is None else f"ended ({self.proc.returncode})"
        return f"<EmailProcess pid {self.pid} {state}: {len(self.emailed)} emails>"


async def _email_process(url: str, stream: str, durable: str, hang_after: int) -> None:
    """The body of an EmailProcess."""
    import nats

    nc = await nats.connect(url, name="msglab-email-process", **tls_options(url))
    sub = await nc.jetstream().pull_subscribe_bind(durable, stream)
    sent = 0
    while True:
        try:
            msgs = await sub.fetch(1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            order = json.loads(msg.data)["id"]
            print(json.dumps({"emailed": order, "delivery": msg.metadata.num_delivered}), flush=True)
            sent += 1
            if sent == hang_after:
                await asyncio.Event().wait()  # stands still here, before the ack, until it is killed
            await msg.ack_sync()


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        _url, _stream, _durable, _hang = sys.argv[2:6]
        asyncio.run(_email_process(_url, _stream, _durable, int(_hang)))
