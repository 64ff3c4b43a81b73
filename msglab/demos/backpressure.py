"""Lesson 05's plumbing: fulfilment workers in real processes, a producer with a pace, and the
queue's depth and age sampled side by side on a live chart.

    shop = await backpressure.Shop.open()          # stream LESSON05_ORDERS, durable "fulfil"
    await shop.workers(1, work=0.01)               # one worker process: 10 ms an order
    run = await shop.overload(rate=150, seconds=3) # a producer faster than its consumer, charted live
    run.depth[-1], run.age[-1]

The workers are `python -m msglab.demos.backpressure` processes, each running the shop's
fulfilment pool (msglab.world.fulfilment, the same the lab's grader runs): `concurrency` workers
on one durable, `work` seconds an order (inside at most `slots` concurrent calls to a warehouse
API, when set), stuck for good on an order whose id is in `hang`. The lesson SIGKILLs them for
real. Depth and age are measured, and the status judged, by that module too: depth is
num_pending + num_ack_pending; age is now minus the stored time of the first message after the
durable's ack floor, on the durable's own subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from msglab.world.fulfilment import depth_and_age, status

STREAM = "LESSON05_ORDERS"  # the shop's orders: lesson05.orders.placed, lesson05.import.*, lesson05.pin
INTAKE = "LESSON05_INTAKE"  # the bounded intake of section 3 (work-queue retention, discard-new)
BOUNDED = "LESSON05_BOUNDED"  # discard_policies' streams, BOUNDED_0 ... BOUNDED_2, each removed after use
STREAMS = (STREAM, INTAKE)
SUBJECT = "lesson05.orders.placed"
DURABLE = "fulfil"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more, a lesson cannot wait that long
MAX_IN_FLIGHT = 64  # publishes of `overload` awaiting their acks at once
ADMISSION_EVERY = 0.02  # seconds: how often the admission check of `overload` measures the age
STREAM_FULL = 10077  # the err_code of a publish refused by a full stream with discard-new


@dataclass
class Series:
    """Depth and age of one queue over time (t in seconds since the run began)."""

    name: str
    t: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    age: list[float] = field(default_factory=list)

    def add(self, t: float, depth: int, age: float) -> None:
        self.t.append(t)
        self.depth.append(depth)
        self.age.append(age)

    def statuses(self, budget: float, window: float) -> list[str]:
        """The status at every sample, each from the samples of the `window` seconds before it."""
        out = []
        for i, now in enumerate(self.t):
            first = next(j for j in range(i + 1) if self.t[j] >= now - window)
            out.append(status(list(zip(self.t[first : i + 1], self.age[first : i + 1], strict=True)), budget))
        return out

    def first(self, wanted: str, budget: float, window: float) -> float | None:
        """When the status first became `wanted`, or None."""
        for t, s in zip(self.t, self.statuses(budget, window), strict=True):
            if s == wanted:
                return t
        return None


# --- the live chart ------------------------------------------------------------------------------


class LiveChart:
    """Depth and age side by side, redrawn in place while a run samples (a static figure outside Jupyter)."""

    COLOURS = ("#0969da", "#cf222e", "#1a7f37", "#bf8700")

    def __init__(self, title: str, series: Sequence[Series], budget: float | None = None) -> None:
        import matplotlib.pyplot as plt

        self.series = list(series)
        self.budget = budget
        self.fig, (self.ax_depth, self.ax_age) = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
        plt.close(self.fig)
        self.fig.suptitle(title, fontsize=10)
        self.handle: Any = None
        self._next_draw = 0.0
        self.marks: dict[str, float] = {}  # label -> seconds: a dotted line on both panels

    def show(self) -> None:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            return
        if get_ipython() is not None:
            self._draw()
            self.handle = display(self.fig, display_id=True)
            self._next_draw = time.monotonic() + 0.5  # the first frame cost the most: give the run a head start

    def draw(self, force: bool = False) -> None:
        """Redraw; while a run samples, at most a sixth of the time goes to drawing (a slow machine draws less)."""
        if not force and time.monotonic() < self._next_draw:
            return
        started = time.monotonic()
        self._draw()
        took = time.monotonic() - started
        self._next_draw = time.monotonic() + max(0.5, 5 * took)

    def _draw(self) -> None:
        for ax in (self.ax_depth, self.ax_age):
            ax.clear()
        for colour, s in zip(self.COLOURS, self.series, strict=False):
            self.ax_depth.plot(s.t, s.depth, color=colour, label=s.name)
            self.ax_age.plot(s.t, s.age, color=colour, label=s.name)
        self.ax_depth.set(xlabel="seconds", ylabel="orders waiting", title="queue depth")
        self.ax_depth.yaxis.get_major_locator().set_params(integer=True)
        self.ax_age.set(xlabel="seconds", ylabel="seconds", title="queue age (oldest unfinished order)")
        if self.budget is not None:
            self.ax_age.axhline(self.budget, color="#8c959f", linestyle="--", label=f"budget {self.budget:g} s")
        for label, at in self.marks.items():
            for ax in (self.ax_depth, self.ax_age):
                ax.axvline(at, color="#cf222e", linestyle=":")
                ax.annotate(label, (at, 0), xytext=(3, 3), textcoords="offset points", color="#cf222e", fontsize=8)
        for ax in (self.ax_depth, self.ax_age):
            ax.set_ylim(bottom=0)
            if len(self.series) > 1 or (ax is self.ax_age and self.budget is not None):
                ax.legend(loc="upper left", frameon=False, fontsize=8)
        if self.handle is not None:
            self.handle.update(self.fig)


# --- the worker processes ---------------------------------------------------------------------------


class Workers:
    """One worker process on a durable: `concurrency` workers, each order taking `work` seconds."""

    def __init__(self, proc: Any, config: dict[str, Any]) -> None:
        self.proc = proc
        self.config = config

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, durable: str, *, concurrency: int = 1, work: float = 0.0, slots: int = 0,
                    hang: Sequence[str] = (), stream: str = STREAM) -> Workers:  # fmt: skip
        from msglab.broker import server_url
        from msglab.broker.server import die_with_parent

        config = {"url": server_url(), "stream": stream, "durable": durable, "concurrency": concurrency,
                  "work": work, "slots": slots, "hang": list(hang), "ack_wait": ACK_WAIT}  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "msglab.demos.backpressure", json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        if line.strip() != b"ready":
            proc.kill()
            raise RuntimeError(f"the worker process did not start: {line!r}")
        return cls(proc, config)

    async def set(self, **changes: Any) -> None:
        """Change concurrency or work while it runs; returns once the workers it stopped have finished the
        orders in their hands."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.config.update(changes)
        self.proc.stdin.write((json.dumps(changes) + "\n").encode())
        await self.proc.stdin.drain()
        while (await asyncio.wait_for(self.proc.stdout.readline(), 10)).strip() not in (b"ok", b""):
            pass  # a "holding" line, said before this answer

    async def holding(self, timeout: float) -> int | None:
        """Which delivery of a stuck order one of these workers now holds (1: the first), or None after
        `timeout` seconds."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            while line := await asyncio.wait_for(self.proc.stdout.readline(), max(0.0, end - time.monotonic())):
                if line.startswith(b"holding "):
                    return int(line.split()[2])
        return None

    def kill(self) -> None:
        """SIGKILL: no cleanup, no ack; what it held comes back after ack_wait."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        await self.proc.wait()


async def _worker_main(config: dict[str, Any]) -> None:
    """The worker process: the shop's fulfilment pool on the durable; a command on stdin changes it,
    answered with "ok" once the workers it stopped have finished the orders in their hands."""
    import nats

    from msglab.broker import tls_options
    from msglab.world.fulfilment import Fulfilment

    nc = await nats.connect(config["url"], name="lesson05-worker", **tls_options(config["url"]))
    # A stuck worker tells the broker it is still on its order ten times an ack_wait: never redelivered, even when
    # a loaded machine holds the process for a few tenths of a second (at three times an ack_wait, it was).
    pool = Fulfilment(nc.jetstream(), config["stream"], config["durable"], slots=config["slots"],
                      progress=config["ack_wait"] / 10)  # fmt: skip
    pool.stuck.update(config["hang"])
    pool.on_hold = lambda order, delivered: print(f"holding {order} {delivered}", flush=True)
    await pool.start(config["concurrency"], config["work"])
    print("ready", flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():  # stdin closes when the lesson goes away
        update = json.loads(line)
        pool.scale(update.get("concurrency", pool.active), update.get("work"))
        await pool.settle(2.0)
        print("ok", flush=True)
    await pool.close()


# --- the shop ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One experiment: what the producer did, and the queues' depth and age over time."""

    series: list[Series]
    published: int = 0
    refused: int = 0
    errors: int = 0
    seconds: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)  # events (a SIGKILL, ...) at seconds into the run
    arrival_rate: float = 0.0  # orders a second the producer reached (accepted and refused)
    drain_rate: float = 0.0  # orders a second the workers finished (acked) during the run
    last_accepted_wait: float | None = None  # the last order accepted before the first refusal: stored to acked

    @property
    def k(self) -> float:
        """How many times as fast orders arrived as they were finished."""
        return self.arrival_rate / self.drain_rate if self.drain_rate else float("inf")

    @property
    def main(self) -> Series:
        return self.series[0]

    @property
    def depth(self) -> list[int]:
        return self.main.depth

    @property
    def age(self) -> list[float]:
        return self.main.age

    def __repr__(self) -> str:
        s = self.main
        return (
            f"{self.published} orders accepted, {self.refused} refused, {self.errors} publish errors in "
            f"{self.seconds:.1f} s; at the end: depth {s.depth[-1]}, age {s.age[-1]:.2f} s "
            f"(highest: depth {max(s.depth)}, age {max(s.age):.2f} s)"
        )


class Shop:
    """The lesson's stream, its fulfilment durable and worker processes, and the experiments."""

    def __init__(self, nc: Any, js: Any) -> None:
        self.nc = nc
        self.js = js
        self.pool: Workers | None = None
        self.others: list[Workers] = []
        self.scaler: Workers | None = None
        self.saved: dict[str, Any] = {}
        self.next_id = 0

    @classmethod
    async def open(cls) -> Shop:
        """A fresh stream LESSON05_ORDERS (lesson05.>) and the durable 'fulfil' on its orders."""
        from msglab.broker import connect, delete_stream

        nc = await connect(name="lesson05-shop")
        js = nc.jetstream()
        for name in STREAMS:
            await delete_stream(js, name)  # in case an earlier run stopped halfway
        await js.add_stream(name=STREAM, subjects=["lesson05.>"])
        shop = cls(nc, js)
        await shop.durable(DURABLE, SUBJECT)
        return shop

    async def durable(self, name: str, subject: str, **config: Any) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig

        config.setdefault("ack_wait", ACK_WAIT)
        await self.js.add_consumer(
            STREAM, ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, **config)
        )

    async def workers(self, concurrency: int, work: float = 0.0, slots: int = 0) -> Workers:
        """The fulfilment workers: one process, started once, then changed in place."""
        if self.pool is None:
            self.pool = await Workers.start(DURABLE, concurrency=concurrency, work=work, slots=slots)
        else:
            await self.pool.set(concurrency=concurrency, work=work)
        return self.pool

    async def measure(self, durable: str = DURABLE, subject: str = SUBJECT) -> tuple[int, float]:
        return await depth_and_age(self.js, STREAM, durable, subject)

    def order(self, prefix: str = "o") -> bytes:
        self.next_id += 1
        return json.dumps({"id": f"{prefix}-{self.next_id:05d}", "sku": "sku-42", "qty": 1}).encode()

    async def _publish_many(self, subject: str, count: int, prefix: str) -> None:
        """`count` orders at once (a core publish each, then a flush), returned once the stream holds them."""
        before = (await self.js.stream_info(STREAM)).state.messages
        for _ in range(count):
            await self.nc.publish(subject, self.order(prefix))
        await self.nc.flush()
        for _ in range(400):
            if (await self.js.stream_info(STREAM)).state.messages >= before + count:
                return
            await asyncio.sleep(0.005)

    async def drain(self) -> None:
        """Let the fulfilment workers finish everything (briefly eight of them, no work), then restore them."""
        assert self.pool is not None
        saved = {k: self.pool.config[k] for k in ("concurrency", "work")}
        await self.pool.set(concurrency=8, work=0.0)
        for _ in range(500):
            depth, _ = await self.measure()
            if depth == 0:
                break
            await asyncio.sleep(0.02)
        await self.pool.set(**saved)

    async def _sample(self, series: list[tuple[Series, str, str]], t0: float, chart: LiveChart | None) -> None:
        for s, durable, subject in series:
            depth, age = await self.measure(durable, subject)
            s.add(time.monotonic() - t0, depth, age)
        if chart is not None:
            chart.draw()

    # -- section 1 and 3: a producer faster than its consumer, with or without an admission check

    async def overload(self, rate: float, seconds: float, budget: float | None = None, every: float = 0.1) -> Run:
        """Publish orders at `rate` a second for `seconds`, sampling depth and age; with `budget`, refuse
        an order (count it, do not publish it) while the queue age is over the budget."""
        await self.drain()
        series = Series("fulfil")
        run = Run([series])
        title = f"{rate:g} orders/s" + (f", refused while the age is over {budget:g} s" if budget else ", all accepted")
        chart = LiveChart(title, [series], budget)
        chart.show()
        t0, done0 = await self._processed()
        age, measured = 0.0, -1.0
        last_seq = 0  # the stream sequence of the last order accepted
        watch: asyncio.Future[float | None] | None = None  # its wait, once the first refusal names it

        async def produce() -> None:
            nonlocal age, measured, last_seq, watch
            # A fixed number of orders, each at its time or at once if late: a stalled event loop (a
            # loaded machine drawing the chart) delays orders, it does not drop them from the flood.
            for n in range(round(rate * seconds)):
                if (wait := n / rate - (time.monotonic() - t0)) > 0:
                    await asyncio.sleep(wait)
                now = time.monotonic() - t0
                if budget is not None and now - measured >= ADMISSION_EVERY:
                    # The age at most ADMISSION_EVERY old: two broker questions per order would cap
                    # the rate a loaded machine reaches below the worker's, and there is no overload.
                    depth, age = await self.measure()
                    measured = now
                    # A sample too: the age that refused an order is on the chart and in the status,
                    # which the 0.1 s sampler alone could miss while refusals keep the age near the budget.
                    series.add(time.monotonic() - t0, depth, age)
                if budget is not None and age > budget:
                    run.refused += 1  # "busy, try later": the customer hears it now
                    if watch is None and last_seq:
                        watch = asyncio.ensure_future(self._wait_of(last_seq))
                    continue
                # Not awaited in turn: a producer waiting for each ack would be paced by the
                # machine's load, not by `rate`, and a loaded machine would show no overload.
                while len(in_flight) >= MAX_IN_FLIGHT:
                    await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.ensure_future(publish(self.order()))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.wait(set(in_flight))

        in_flight: set[asyncio.Future[None]] = set()

        async def publish(order: bytes) -> None:
            nonlocal last_seq
            try:
                seq = (await self.js.publish(SUBJECT, order)).seq
            except Exception:
                run.errors += 1
                return
            run.published += 1
            last_seq = max(last_seq, seq)

        producer = asyncio.ensure_future(produce())
        while not producer.done():
            await self._sample([(series, DURABLE, SUBJECT)], t0, chart)
            await asyncio.sleep(every)
        await producer
        t1, done1 = await self._processed()
        await self._sample([(series, DURABLE, SUBJECT)], t0, chart)
        chart.draw(force=True)
        run.seconds = time.monotonic() - t0
        run.arrival_rate = (run.published + run.refused + run.errors) / (t1 - t0)
        run.drain_rate = (done1 - done0) / (t1 - t0)
        if watch is not None:
            run.last_accepted_wait = await watch
        return run

    async def _wait_of(self, seq: int, give_up: float = 30.0) -> float | None:
        """Seconds from when the stream stored order `seq` to when the durable saw it acked (None: not in time)."""
        stored = (await self.js.get_msg(STREAM, seq)).time.timestamp()
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            if (await self.js.consumer_info(STREAM, DURABLE)).ack_floor.stream_seq >= seq:
                return time.time() - stored
            await asyncio.sleep(0.01)
        return None

    # -- section 2: the same depth, two speeds; one stuck order; a pinned ack floor

    async def same_depth(self, orders: int, seconds: float, slow_work: float = 0.5) -> Run:
        """Two queues get the same import of `orders`: eight quick workers drain one, a single worker taking
        `slow_work` s an order the other. The clock starts before the imports, so no order's age runs ahead
        of it; sampled for `seconds` after the workers start, and on until the quick queue is empty and for
        as long again as it took (at most 60 s more: a loaded machine is slow, not wrong), so the slow
        queue's age is past the quick one's highest however slow the machine. `marks["workers start"]`."""
        fast, slow = Series("eight quick workers"), Series(f"one worker, {slow_work:g} s an order")
        for name in ("fast", "slow"):
            await self.durable(name, f"lesson05.import.{name}", ack_wait=30)
        pools = [  # idle until both imports are stored
            await Workers.start("fast", concurrency=0),
            await Workers.start("slow", concurrency=0, work=slow_work),
        ]
        self.others += pools
        t0 = time.monotonic()
        for name in ("fast", "slow"):
            await self._publish_many(f"lesson05.import.{name}", orders, name)
        chart = LiveChart(f"the same import of {orders:,} orders, two speeds", [fast, slow])
        chart.show()
        watched = [(fast, "fast", "lesson05.import.fast"), (slow, "slow", "lesson05.import.slow")]
        await self._sample(watched, t0, chart)
        await pools[0].set(concurrency=8)
        await pools[1].set(concurrency=1)
        started = time.monotonic() - t0
        emptied: float | None = None
        while True:
            await asyncio.sleep(0.1)
            await self._sample(watched, t0, chart)
            now = fast.t[-1]
            if emptied is None and fast.depth[-1] == 0:
                emptied = now
            if (emptied is not None and now - started >= max(seconds, emptied)) or now - started > seconds + 60:
                break
        chart.marks = {"workers start": started}
        chart.draw(force=True)
        run = Run([fast, slow], published=2 * orders, seconds=time.monotonic() - t0, marks={"workers start": started})
        for pool in pools:
            await pool.close()
        return run

    async def one_stuck(self, rate: float, hang: float, settle: float = 5.0) -> Run:
        """Orders trickle in at `rate` a second and two workers keep up; a worker in a process of its own is
        stuck on one order (retrying, and telling the broker it is still on it). After `hang` seconds that
        process is SIGKILLed; sampled until the order is done (at most `settle` s more)."""
        await self.drain()
        series = Series("fulfil")
        run = Run([series])
        chart = LiveChart(f"{rate:g} orders/s, two workers keep up; a third is stuck on one order", [series])
        chart.show()
        hung = await Workers.start(DURABLE, concurrency=1, hang=["o-bad"])
        self.others.append(hung)
        assert self.pool is not None
        saved = {k: self.pool.config[k] for k in ("concurrency", "work")}
        await self.pool.set(concurrency=0)  # the stuck process takes the bad order first
        await self.js.publish(SUBJECT, json.dumps({"id": "o-bad", "sku": "sku-13", "qty": 1}).encode())
        delivered = await hung.holding(4 * ACK_WAIT)
        if delivered != 1:
            # The stalled pool's last pull can still be open on the server and take the order (a loaded
            # machine); it would ack that stale copy once it works again, settling the order the stuck worker
            # holds. So a new pool process: the old one's SIGKILL drops the copy (after ack_wait it comes back).
            await self.pool.close()
            config = self.pool.config
            self.pool = await Workers.start(DURABLE, concurrency=0, work=config["work"], slots=config["slots"])
            if delivered is None and await hung.holding(30) is None:  # a loaded machine is slow, not wrong
                raise RuntimeError("the stuck worker never received its order")
        t0 = time.monotonic()  # the hang is timed from when the stuck worker holds the order
        await self.pool.set(concurrency=2, work=0.005)

        flowing = True

        async def trickle() -> None:
            while flowing:
                await self.js.publish(SUBJECT, self.order())
                run.published += 1
                await asyncio.sleep(1 / rate)

        producer = asyncio.ensure_future(trickle())
        try:
            while time.monotonic() - t0 < hang:
                await self._sample([(series, DURABLE, SUBJECT)], t0, chart)
                await asyncio.sleep(0.1)
            hung.kill()  # a real SIGKILL: the order it held comes back after ack_wait
            run.marks["SIGKILL"] = time.monotonic() - t0
            while time.monotonic() - t0 < hang + settle:
                await self._sample([(series, DURABLE, SUBJECT)], t0, chart)
                if series.t[-1] - run.marks["SIGKILL"] > ACK_WAIT and series.age[-1] < 0.1:
                    break
                await asyncio.sleep(0.1)
        finally:
            # Told to stop, not cancelled: nats-py 2.16 can swallow a cancellation inside a publish.
            flowing = False
            await asyncio.wait([producer], timeout=10)
        await hung.close()
        self.others.remove(hung)
        await self.pool.set(**saved)
        chart.marks = dict(run.marks)
        chart.draw(force=True)
        run.seconds = time.monotonic() - t0
        return run

    async def pinned_floor(self, wait: float = 0.6) -> dict[str, Any]:
        """A durable with max_deliver=1: its one delivery is never acked, ack_wait runs out."""
        await self.durable("pin", "lesson05.pin", ack_wait=0.2, max_deliver=1)
        sub = await self.js.pull_subscribe_bind("pin", STREAM)
        await self.js.publish("lesson05.pin", self.order("p"))
        await sub.fetch(1, timeout=1)  # delivered once, never acked: it will not be delivered again
        await asyncio.sleep(wait)  # ack_wait (0.2 s) runs out, and more
        depth, age = await self.measure("pin", "lesson05.pin")
        await self.js.publish("lesson05.pin", self.order("p"))
        for msg in await sub.fetch(1, timeout=1):
            await msg.ack_sync()  # the next ack on the durable
        after = await self.measure("pin", "lesson05.pin")
        await sub.unsubscribe()
        return {"depth": depth, "age": age, "depth after the next ack": after[0], "age after": after[1]}

    # -- section 3: scale the consumers

    async def _processed(self) -> tuple[float, int]:
        """(now, orders the durable has seen acked so far): deliveries minus those still unacked."""
        info = await self.js.consumer_info(STREAM, DURABLE)
        return time.monotonic(), info.delivered.consumer_seq - info.num_ack_pending

    async def scale_out(self, counts: Sequence[int], slots: int, work: float, window: float = 0.8) -> dict[int, float]:
        """Orders per second with 1, 2, 4, ... workers on one durable, when every order needs a call to a
        warehouse API that takes `slots` calls at once, `work` seconds each (counted on the server)."""
        scaler = self.scaler = await Workers.start(DURABLE, concurrency=0, work=work, slots=slots)
        self.others.append(scaler)
        assert self.pool is not None
        self.saved = {k: self.pool.config[k] for k in ("concurrency", "work")}
        await self.pool.set(concurrency=0)  # only the scaled workers take orders now
        needed = sum(min(n, slots) / work for n in counts) * (window + 0.3) * 1.5 + 50  # never runs dry
        await self._publish_many(SUBJECT, int(needed), "s")
        result = {}
        try:
            for n in counts:
                await scaler.set(concurrency=n)
                await self._holding(n)  # every worker has an order before the window opens
                t0, done0 = await self._processed()
                await asyncio.sleep(window)
                t1, done1 = await self._processed()
                result[n] = (done1 - done0) / (t1 - t0)
        finally:
            await scaler.set(concurrency=0)
        return result

    async def _holding(self, workers: int, give_up: float = 3.0) -> None:
        """Wait until `workers` orders are out unacked on the durable (each worker holds one), at most `give_up` s:
        on a loaded machine the workers take longer to get going, and a window opened earlier undercounts them."""
        deadline = time.monotonic() + give_up
        while time.monotonic() < deadline:
            if (await self.js.consumer_info(STREAM, DURABLE)).num_ack_pending >= workers:
                return
            await asyncio.sleep(0.01)

    async def in_flight(self, workers: int, max_ack_pending: int | None, slots: int, work: float,
                        seconds: float = 0.8) -> dict[str, float]:  # fmt: skip
        """With `workers` workers and max_ack_pending as given: the most orders handed out and not yet
        acked at once (sampled), and orders per second."""
        from nats.js.api import AckPolicy, ConsumerConfig

        limit = max_ack_pending or 1000  # JetStream's default
        config = ConsumerConfig(durable_name=DURABLE, filter_subject=SUBJECT, ack_policy=AckPolicy.EXPLICIT,
                                ack_wait=ACK_WAIT, max_ack_pending=limit)  # fmt: skip
        await self.js.add_consumer(STREAM, config)  # add_consumer on an existing durable updates it
        scaler = self.scaler
        assert scaler is not None
        await scaler.set(concurrency=workers, work=work)
        peak = 0
        t0, done0 = await self._processed()
        try:
            while time.monotonic() - t0 < seconds:
                info = await self.js.consumer_info(STREAM, DURABLE)
                peak = max(peak, info.num_ack_pending)
                await asyncio.sleep(0.02)
            t1, done1 = await self._processed()
        finally:
            await scaler.set(concurrency=0)
        return {"most in flight": peak, "orders/s": round((done1 - done0) / (t1 - t0), 1)}

    async def reset(self) -> None:
        """After scale_out: stop its workers, throw away the rest of its backlog, restore max_ack_pending
        and the fulfilment workers as they were."""
        if self.scaler is not None:
            await self.scaler.close()
            self.others.remove(self.scaler)
            self.scaler = None
        await self.js.purge_stream(STREAM, subject=SUBJECT)
        await self.durable(DURABLE, SUBJECT, max_ack_pending=1000)
        if self.pool is not None and self.saved:
            await self.pool.set(**self.saved)
        for _ in range(100):
            if (await self.measure())[0] == 0:
                return
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop every worker process, delete the lesson's streams, close the connection."""
        from msglab.broker import delete_stream

        for pool in [*self.others, *([self.pool] if self.pool else [])]:
            await pool.close()
        for name in STREAMS:
            await delete_stream(self.js, name)
        await self.nc.close()


async def bounded_intake(js: Any, limit: int) -> None:
    """The stream LESSON05_INTAKE: work-queue retention (an acked order is deleted), at most `limit`
    orders, and a publish over the limit is refused (discard-new)."""
    from nats.js.api import DiscardPolicy, RetentionPolicy

    from msglab.broker import delete_stream

    await delete_stream(js, INTAKE)
    await js.add_stream(
        name=INTAKE, subjects=["lesson05intake.>"], retention=RetentionPolicy.WORK_QUEUE, max_msgs=limit,
        discard=DiscardPolicy.NEW,
    )  # fmt: skip


async def discard_policies(js: Any, limit: int = 3, orders: int = 5, max_age: float = 0.2) -> Any:
    """`orders` published to three streams of their own: at most `limit` messages with the default discard
    policy (old) and with discard new, and one with `max_age`, read once the age has passed. Per stream:
    publishes confirmed and refused (err_code), orders kept."""
    from nats.js.api import DiscardPolicy
    from nats.js.errors import APIError

    from msglab.broker import delete_stream
    from msglab.notebook.table import Table

    setups: list[tuple[str, dict[str, Any]]] = [
        (f"max_msgs {limit}, discard old (the default)", {"max_msgs": limit}),
        (f"max_msgs {limit}, discard new", {"max_msgs": limit, "discard": DiscardPolicy.NEW}),
        (f"max_age {max_age:g} s", {"max_age": max_age}),
    ]
    rows = []
    for i, (label, limits) in enumerate(setups):
        name, subject = f"{BOUNDED}_{i}", f"lesson05bounded.{i}"
        await delete_stream(js, name)
        await js.add_stream(name=name, subjects=[subject], **limits)
        try:
            confirmed, refused = 0, []
            for n in range(1, orders + 1):
                try:
                    await js.publish(subject, f"o-{n}".encode())
                    confirmed += 1
                except APIError as exc:
                    refused.append(exc.err_code)
            published, after = time.monotonic(), ""
            if "max_age" in limits:  # unread, the orders grow older than max_age: wait until the stream drops them
                for _ in range(int((max_age + 10) / 0.01)):
                    if not (await js.stream_info(name)).state.messages:
                        break
                    await asyncio.sleep(0.01)
                after = f" ({time.monotonic() - published:.2f} s later)"
            state = (await js.stream_info(name)).state
            kept = [(await js.get_msg(name, seq)).data.decode() for seq in range(state.first_seq, state.last_seq + 1)]
            shown = (", ".join(kept) if state.messages else "none") + after
            rows.append([label, confirmed, f"{len(refused)} ({refused[0]})" if refused else "0", shown])
        finally:
            await delete_stream(js, name)
    return Table([f"{orders} orders published to", "confirmed", "refused (err_code)", "kept"], rows)


def status_chart(runs: Sequence[tuple[str, Series]], budget: float, window: float) -> Any:
    """Each run's queue age with its status (OK / WARNING / ERROR) painted behind it."""
    import matplotlib.pyplot as plt

    colours = {"OK": "#dafbe1", "WARNING": "#fff8c5", "ERROR": "#ffebe9"}
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 2.8), layout="constrained", squeeze=False)
    plt.close(fig)
    for ax, (title, s) in zip(axes[0], runs, strict=True):
        statuses = s.statuses(budget, window)
        for i, st in enumerate(statuses):
            end = s.t[i + 1] if i + 1 < len(s.t) else s.t[i] + 0.1
            ax.axvspan(s.t[i], end, color=colours[st], linewidth=0)
        ax.plot(s.t, s.age, color="#24292f")
        ax.axhline(budget, color="#8c959f", linestyle="--")
        ax.set(title=title, xlabel="seconds", ylabel="queue age, s")
        ax.set_ylim(bottom=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="outside right center", frameon=False, fontsize=8)
    return fig


def main(argv: Sequence[str] | None = None, run: Callable[..., Any] = asyncio.run) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    run(_worker_main(json.loads(args[0])))


if __name__ == "__main__":
    main()
