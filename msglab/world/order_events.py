"""Order events and the ledger that applies them: module 06's workload and its evidence of per-key order.

The workload is a value: `workload(seed, orders=...)` returns the events of `orders` orders in the
order a shop would publish them. Each order's events are created, paid, then shipped or cancelled
(`Event.seq` 1, 2, 3 within its order); orders overlap in time, so the events of different orders
interleave; a few customers place most orders (`skew`), as on a real shop, so a key by customer
makes hot partitions. Same seed, same events, in every process.

    events = workload(seed=7, orders=100)
    events[0].key, events[0].seq, events[0].kind, events[0].customer   # 'o-0003', 1, 'created', 'c-01'
    Event.from_bytes(events[0].to_bytes()) == events[0]

Partitioning, computed as the server computes it: `partition(key, n)` is FNV-1a 32 of the key's
bytes mod n, which is what nats-server's subject-mapping function `{{partition(n,1)}}` gives for
a one-token key (several tokens are hashed concatenated, no separator; checked on nats-server 2.15.1
for 1,000 keys). `jump(key, n)` is jump consistent hashing (Lamping and Veach) over the same hash;
`moved(keys, place, n)` is the fraction of keys `place` puts elsewhere at n + 1 than at n.

The ledger is where events are applied, and the one place that counts what went wrong:

    ledger = Ledger(events)                 # what should be applied, to compare with
    ledger.apply(event, worker="w1")        # record one application (the worker's name, the time)
    ledger.report()                         # Report: applied, violations, duplicates, missing, wrong_final, ...

A violation is an event applied after a later event of its key was applied (per-key order broken);
a duplicate is an event applied more than once; `wrong_final` counts orders whose state, replaying
every application in the order it was made (duplicates too: a stalled worker's late "created" sets a
shipped order back), is not their true last state (a cancelled order left "paid" ships).
`overlaps` counts keys two workers held at once, from the (start, end) each apply reports.

Over NATS, for worker processes: `await serve(nc, subject, ledger)` answers apply requests on a
connection of the serving process (a lesson's kernel, or a grader: the evidence stays in its
memory, out of the workers' reach); a worker calls `await apply(nc, subject, event, worker)` and
gets "ok" once it is recorded. Requests are recorded in the order the server delivers them; a
worker that waits for "ok" before acking has its applications recorded in the order it made them.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("created", "paid", "shipped", "cancelled")
# Seconds a worker spends applying each kind, scaled down: a payment is checked with the bank, a
# cancellation only flips a flag, so a cancellation handed to a second worker can finish first.
WORK = {"created": 0.006, "paid": 0.010, "shipped": 0.004, "cancelled": 0.002}


@dataclass(frozen=True)
class Event:
    """One event of one order: its key (the order id), place in the order (1, 2, 3), kind and customer."""

    key: str
    seq: int
    kind: str
    customer: str
    n: int = 0  # its place in the workload's publish order

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Event:
        return cls(**json.loads(data))

    @property
    def work(self) -> float:
        """Seconds a worker spends applying it."""
        return WORK[self.kind]


def workload(seed: int, orders: int = 100, *, customers: int = 20, skew: float = 1.2, overlap: int = 4) -> list[Event]:
    """The events of `orders` orders in publish order, seeded.

    Customer i places orders with weight 1 / i**skew (skew 0: all alike). About `overlap` orders are
    open at once, so an order's events are near each other in the stream but interleave with others'.
    A fifth of the orders are cancelled after payment instead of shipped.
    """
    rng = random.Random(seed)
    weights = [1 / (i**skew) for i in range(1, customers + 1)]
    names = [f"c-{i:02d}" for i in range(1, customers + 1)]
    pending: list[list[Event]] = []
    out: list[Event] = []
    started = 0
    ids = rng.sample(range(1, 10 * orders + 1), orders)  # order ids not in publish order
    while started < orders or pending:
        while started < orders and len(pending) < overlap:
            key, who = f"o-{ids[started]:04d}", rng.choices(names, weights)[0]
            last = "cancelled" if rng.random() < 0.2 else "shipped"
            pending.append([Event(key, s, kind, who) for s, kind in enumerate(("created", "paid", last), 1)])
            started += 1
        chain = rng.choice(pending)
        event = chain.pop(0)
        out.append(Event(event.key, event.seq, event.kind, event.customer, len(out)))
        if not chain:
            pending.remove(chain)
    return out


class OrderRejected(Exception):
    """The order system refused to apply this event: the order is on hold until the back office resolves it."""


def rejected_text(event: Event) -> str:
    return f"order {event.key} is on hold (payment under review); {event.kind} (event {event.seq}) not applied"


# --- partitions ---------------------------------------------------------------------------------------


def fnv1a32(data: bytes) -> int:
    """FNV-1a, 32 bits: the hash nats-server's partition() mapping uses."""
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def partition(key: str, n: int) -> int:
    """The partition nats-server's `{{partition(n,1)}}` gives a one-token key: FNV-1a 32 mod n."""
    return fnv1a32(key.encode()) % n


def jump(key: str, n: int) -> int:
    """Jump consistent hashing of the key's 64-bit FNV-1a into n buckets: n to n + 1 moves about 1/(n+1)."""
    h = 0xCBF29CE484222325
    for byte in key.encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    b, j = -1, 0
    while j < n:
        b = j
        h = (h * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((h >> 33) + 1)))
    return b


def moved(keys: Iterable[str], place: Callable[[str, int], int], n: int) -> float:
    """The fraction of keys that `place` puts in another partition at n + 1 than at n."""
    keys = list(keys)
    return sum(place(k, n) != place(k, n + 1) for k in keys) / len(keys)


def spread(keys: Iterable[str], n: int, place: Callable[[str, int], int] = partition) -> list[int]:
    """How many of `keys` (one per event, repeats counted) land in each of n partitions."""
    counts = Counter(place(k, n) for k in keys)
    return [counts[p] for p in range(n)]


# --- the ledger --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """One application: which event, by which worker, when it started and ended (the ledger's clock)."""

    key: str
    seq: int
    kind: str
    worker: str
    start: float
    end: float


@dataclass
class Report:
    """What the ledger saw: counts, and the first few violations as evidence."""

    applied: int
    distinct: int
    expected: int
    violations: int
    duplicates: int
    missing: int
    wrong_final: int
    overlaps: int
    by_worker: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"{self.applied} applied ({self.distinct} of {self.expected} events), {self.violations} out of order, "
            f"{self.duplicates} twice, {self.missing} missing, {self.wrong_final} orders in the wrong final state"
        )


class Ledger:
    """Applies events and records each application; `report()` counts what broke per-key order."""

    def __init__(self, expected: Sequence[Event] = ()) -> None:
        self.expected = list(expected)
        self.log: list[Applied] = []

    def apply(self, event: Event, worker: str, start: float | None = None) -> None:
        """Record that `worker` applied `event` (started at `start`, by default now; ends now)."""
        now = time.monotonic()
        self.log.append(Applied(event.key, event.seq, event.kind, worker, now if start is None else start, now))

    def clear(self) -> None:
        self.log.clear()

    def __len__(self) -> int:
        return len(self.log)

    def distinct(self) -> int:
        return len({(a.key, a.seq) for a in self.log})

    def report(self) -> Report:
        highest: dict[str, int] = {}
        seen: set[tuple[str, int]] = set()
        violations = duplicates = 0
        examples: list[str] = []
        state: dict[str, str] = {}
        for a in self.log:
            if (a.key, a.seq) in seen:
                duplicates += 1
                # A late duplicate is applied all the same: "created" again after "shipped" sets the order back.
                state[a.key] = a.kind
                continue
            seen.add((a.key, a.seq))
            if a.seq < highest.get(a.key, 0):
                violations += 1
                if len(examples) < 3:
                    examples.append(f"{a.key}: {a.kind} (event {a.seq}) applied after event {highest[a.key]}")
            highest[a.key] = max(highest.get(a.key, 0), a.seq)
            state[a.key] = a.kind  # a naive projection: the last applied event is the state
        last: dict[str, Event] = {}
        for e in self.expected:
            if e.key not in last or e.seq > last[e.key].seq:
                last[e.key] = e
        truth = {key: e.kind for key, e in last.items()}
        wanted = {(e.key, e.seq) for e in self.expected}
        wrong = sum(1 for key, kind in truth.items() if key in state and state[key] != kind)
        return Report(
            applied=len(self.log),
            distinct=len(seen),
            expected=len(wanted),
            violations=violations,
            duplicates=duplicates,
            missing=len(wanted - seen),
            wrong_final=wrong,
            overlaps=self.overlaps(),
            by_worker=dict(Counter(a.worker for a in self.log)),
            examples=examples,
        )

    def overlaps(self) -> int:
        """Keys that two different workers held at once (their (start, end) intervals intersect)."""
        spans: dict[str, list[Applied]] = defaultdict(list)
        for a in self.log:
            spans[a.key].append(a)
        count = 0
        for applies in spans.values():
            applies.sort(key=lambda a: a.start)
            if any(x.worker != y.worker and y.start < x.end for i, x in enumerate(applies) for y in applies[i + 1 :]):
                count += 1
        return count


# --- over NATS ---------------------------------------------------------------------------------------


async def serve(nc: Any, subject: str, ledger: Ledger) -> Any:
    """Answer apply requests on `subject` with "ok" once recorded; returns the subscription."""

    async def on_apply(msg: Any) -> None:
        body = json.loads(msg.data)
        held = float(body.get("held", 0.0))  # how long the worker has held it: a duration, no clocks compared
        ledger.apply(Event(**body["event"]), body["worker"], start=time.monotonic() - held)
        await msg.respond(b"ok")

    sub = await nc.subscribe(subject, cb=on_apply)
    await nc.flush()
    await nc.flush()  # the SUB is on the server before anyone asks (see broker.settle_subscriptions)
    return sub


async def apply(nc: Any, subject: str, event: Event, worker: str, *, held: float = 0.0, timeout: float = 5.0) -> None:
    """Ask the ledger to record that `worker` applied `event`, having held it `held` seconds; returns once
    it is recorded."""
    body = {"event": asdict(event), "worker": worker, "held": held}
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    if reply.data != b"ok":
        raise RuntimeError(f"the ledger refused: {reply.data!r}")
