"""Lesson 04's plumbing: an email worker in a real process, an email provider that fails, and the counts.

    provider = demo.start_provider()            # the course's email provider, its own process
    bench = demo.Bench(nc, provider)
    result = await bench.run(handler, ["o-1042 bounce", *demo.orders(20)], max_deliver=5)
    result.deliveries("o-1042"), result.gaps("o-1042"), result.dlq_table()

`Bench.run` ships the cell's handler (and the helpers and constants it uses) to a worker process of
its own, through the grading harness with this module as the "grader", on a stream and durable made
for that run (`max_deliver`, `backoff`, `max_ack_pending`, `ack_wait` as asked). Each email is a
string "<order id> <kind>": ok, bounce (the provider answers 422 forever), template (400: the
template is not deployed), unreachable (502: the recipient's mail server is down), outage (an
ordinary email, but the provider is down for `outage` seconds from the run's first request),
reset_after_send (the provider sends it, then the connection drops: the worker sees a reset). A
handler's `env.send_email(email, idempotency_key=...)` sends the key as the Idempotency-Key header.
Every delivery, settle (ack, nak with its delay, term), provider answer, dead letter and kill is recorded in the
notebook's process with its clock, and every email the provider's store holds from the run; `Result` counts
them. `kill="after_dead_letter"` SIGKILLs the first worker right after the DLQ stream confirmed its first
dead letter, and starts a second one.
`copier=` runs a second process that turns the server's MAX_DELIVERIES advisories into dead
letters; `redrive=` runs a cell's redrive function after `fix` (the causes of those orders are
fixed at the provider), `redrive_runs` times, `redrive_gap` seconds apart; `window` shortens the email
stream's duplicate window (where redriven emails land), so a rerun can come after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from msglab.grading.harness import Child, Run
from msglab.grading.nemesis import Crash
from msglab.grading.scaffold import HeldSpawns, held
from msglab.notebook.table import Table
from msglab.world import email_provider as ep
from msglab.world import email_requests as er
from msglab.world.email_provider import EmailApiError  # the class a worker's send_email raises

STREAMS = ("LESSON04_EMAILS", "LESSON04_EMAILS_DLQ", "LESSON04_ADVISORIES", "LESSON04_PROBE")
STREAM, DLQ_STREAM, ADVISORY_STREAM, PROBE_STREAM = STREAMS
SUBJECT = "lesson04.orders.email"
DLQ_SUBJECT = "lesson04.orders.email.dlq"
DURABLE = "email"
ADVISORY_DURABLE = "dead_letters"
PROVIDER_PREFIX = "lesson04.provider"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more
KINDS = ("ok", "bounce", "template", "unreachable", "outage", "reset_after_send")
HEADER = "from __future__ import annotations\n\nimport asyncio\nimport json\nimport time\nfrom typing import Any\n"

_provider: ep.Provider | None = None


def start_provider() -> ep.Provider:
    """Start the lesson's email provider process (stopping one this kernel started before)."""
    global _provider
    if _provider is not None:
        _provider.stop()
    _provider = ep.start(prefix=PROVIDER_PREFIX)
    return _provider


def orders(count: int, start: int = 2001) -> list[str]:
    """`count` ordinary emails: ["o-2001 ok", "o-2002 ok", ...]."""
    return [f"o-{start + i} ok" for i in range(count)]


# --- what runs inside the worker processes ---------------------------------------------------


def _add_effects(env: Any) -> None:
    """env.send_email (answered by the notebook's side, which asks the provider), the DLQ subject, and a
    watch on dead letters: a confirmed publish to the DLQ is a call the run may SIGKILL the process on."""
    from nats.js.client import JetStreamContext

    async def send_email(email: Any, idempotency_key: str | None = None) -> str:
        detail = {"to": str(email.get("to")), "template": str(email.get("template"))}
        if idempotency_key is not None:
            detail["idempotency_key"] = str(idempotency_key)
        return env.world.call("send_email", str(email.get("order_id")), **detail)

    env.send_email = send_email
    env.EmailApiError = EmailApiError
    env.dlq_subject = env.subject(DLQ_SUBJECT)
    dlq, publish = env.subject(DLQ_SUBJECT), JetStreamContext.publish

    async def watched(self: Any, subject: str, payload: bytes = b"", *args: Any, **kwargs: Any) -> Any:
        ack = await publish(self, subject, payload, *args, **kwargs)
        if subject == dlq:
            headers = kwargs.get("headers") or (args[2] if len(args) > 2 else None) or {}
            env.world.call("dead_letter", headers.get("Order-Id"), duplicate=bool(ack.duplicate), seq=ack.seq)
        return ack

    JetStreamContext.publish = watched  # type: ignore[method-assign]


def _record_settles(env: Any, msg: Any, key: str) -> None:
    """Note every ack, nak (with its delay) and term the handler makes on this delivery."""
    n, seq = msg.metadata.num_delivered, msg.metadata.sequence.stream
    ack, ack_sync, nak, term = msg.ack, msg.ack_sync, msg.nak, msg.term

    async def noted_ack() -> None:
        await ack()
        env.world.note("settle", key, how="ack", n=n, seq=seq)

    async def noted_ack_sync(timeout: float = 1.0) -> Any:
        reply = await ack_sync(timeout=timeout)
        env.world.note("settle", key, how="ack", n=n, seq=seq)
        return reply

    async def noted_nak(delay: float | None = None) -> None:
        await nak(delay=delay)
        env.world.note("settle", key, how="nak", n=n, seq=seq, delay=delay or 0.0)

    async def noted_term() -> None:
        await term()
        env.world.note("settle", key, how="term", n=n, seq=seq)

    msg.ack, msg.ack_sync, msg.nak, msg.term = noted_ack, noted_ack_sync, noted_nak, noted_term


async def role_worker(env: Any, learner: Any) -> None:
    """One email worker: wait for its turn, then fetch one email at a time and hand it to the handler."""
    _add_effects(env)
    handler = getattr(learner, env.params["handler"])
    held(env)
    sub = await env.js.pull_subscribe_bind(env.durable(DURABLE), env.stream(STREAM))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.5)
        except TimeoutError:
            continue
        for msg in msgs:
            key = (msg.headers or {}).get("Order-Id", "?")
            env.world.note("delivery", key, n=msg.metadata.num_delivered, seq=msg.metadata.sequence.stream)
            _record_settles(env, msg, key)
            try:
                await handler(env, msg)
            finally:
                env.world.note("handled", key)


async def role_copier(env: Any, learner: Any) -> None:
    """The small process that turns MAX_DELIVERIES advisories into dead letters (the cell's function)."""
    _add_effects(env)
    env.advisories_stream = env.stream(ADVISORY_STREAM)
    env.advisories_durable = env.durable(ADVISORY_DURABLE)
    await getattr(learner, env.params["copier"])(env)


# --- the cell's code, as a module --------------------------------------------------------------


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _plain(value: Any) -> bool:
    if isinstance(value, str | int | float | bool | bytes | type(None)):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def write_module(*functions: Callable[..., Any]) -> tuple[str, str]:
    """Write functions of a notebook as a module, with the notebook's functions and plain constants they use.

    A function is shipped if the cell defined it (its module is the notebook's); a constant if it is
    a number, a string, or a list, tuple or dict of those (DELAYS = [0.05, 0.1]). Returns (folder, path).
    """
    shipped: dict[str, str] = {}
    constants: dict[str, str] = {}
    todo = list(functions)
    while todo:
        function = todo.pop()
        if function.__name__ in shipped:
            continue
        shipped[function.__name__] = textwrap.dedent(inspect.getsource(function))
        for name in sorted(_names_used(function.__code__)):
            value = function.__globals__.get(name)
            if inspect.isfunction(value) and value.__module__ == function.__module__ and name not in shipped:
                todo.append(value)
            elif _plain(value) and not name.startswith("__") and value is not None:
                constants[name] = f"{name} = {value!r}\n"
    folder = tempfile.mkdtemp(prefix="msglab-lesson04-")
    path = os.path.join(folder, "handler.py")
    body = HEADER + "\n" + "".join(constants.values()) + "\n\n" + "\n\n".join(reversed(shipped.values()))
    Path(path).write_text(body)
    return folder, path


# --- the bench ---------------------------------------------------------------------------------


def parse(spec: str) -> er.EmailRequest:
    """An email request from "o-1042 bounce" (msglab.world.email_requests gives its address and template)."""
    order, _, kind = spec.partition(" ")
    kind = kind or "ok"
    if kind not in KINDS:
        raise ValueError(f"{spec!r}: the kind is one of {', '.join(KINDS)}")
    if kind == "reset_after_send":  # the provider's scripted first answer for this address
        return er.EmailRequest.make(order, "flaky", script=("reset_after_send",))
    return er.EmailRequest.make(order, kind)  # outage: an ordinary email, sent while the provider is down


@dataclass
class Row:
    t: float  # seconds since the first email was published
    # published, delivery, settle, attempt, email, dead_letter, kill, exhausted, advisory, fixed, redrive, end
    kind: str
    order: str
    detail: dict[str, Any] = field(default_factory=dict)


class Bench:
    """The lesson's runs: each in processes of its own, against the lesson's email provider."""

    def __init__(self, nc: Any, provider: ep.ProviderView) -> None:
        self.nc = nc
        self.provider = provider

    def __repr__(self) -> str:
        return f"<bench: email worker processes on {SUBJECT}, DLQ {DLQ_SUBJECT}, provider {self.provider.subject}>"

    async def run(
        self,
        handler: Callable[..., Any],
        emails: Sequence[str],
        *,
        max_deliver: int = -1,
        backoff: Sequence[float] | None = None,
        max_ack_pending: int = 1000,
        ack_wait: float = ACK_WAIT,
        seconds: float | None = None,
        outage: float = 0.0,
        kill: str | None = None,
        copier: Callable[..., Any] | None = None,
        fix: Sequence[str] = (),
        redrive: Callable[..., Awaitable[Any]] | None = None,
        redrive_runs: int = 1,
        redrive_gap: float = 0.0,
        window: float | None = None,
        timeout: float = 8.0,
    ) -> Result:
        """Publish the emails, run `handler` on them in a worker process, and return what happened.

        The run ends `seconds` after the worker starts, or once every email is settled for good (acked,
        termed, or out of deliveries), or at `timeout`.
        """
        if kill not in (None, "after_dead_letter"):
            raise ValueError("kill is None or 'after_dead_letter'")
        plan = [parse(spec) for spec in emails]
        functions = [handler] + ([copier] if copier else [])
        folder, path = write_module(*functions)
        started = time.perf_counter()
        try:
            async with Run(__name__, path, 0) as lab:
                return await _Runner(self, lab, plan).go(
                    handler, max_deliver=max_deliver, backoff=backoff, max_ack_pending=max_ack_pending,
                    ack_wait=ack_wait, seconds=seconds, outage=outage, kill=kill, copier=copier, fix=fix,
                    redrive=redrive, redrive_runs=redrive_runs, redrive_gap=redrive_gap, window=window,
                    timeout=timeout, started=started,
                )  # fmt: skip
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class _Runner:
    def __init__(self, bench: Bench, lab: Run, plan: list[er.EmailRequest]) -> None:
        self.bench = bench
        self.lab = lab
        self.plan = plan
        self.rows: list[Row] = []
        self.t0 = self.since = time.time()  # since: the provider's emails from before belong to earlier runs
        self.exhausted: dict[int, float] = {}
        self.advisories = 0

    def row(self, kind: str, order: str, ts: float | None = None, **detail: Any) -> None:
        self.rows.append(Row((time.time() if ts is None else ts) - self.t0, kind, order, detail))

    async def go(self, handler: Callable[..., Any], **o: Any) -> Result:
        from nats.js.api import AckPolicy, ConsumerConfig

        lab, names, bench = self.lab, self.lab.names, self.bench
        self._serve_effects()
        # The workers start while the streams are made: they wait for their turn before fetching.
        params = {"handler": handler.__name__}
        kill = [Crash("dead_letter", 1, "after")] if o["kill"] else []
        spawns = HeldSpawns(lab, "worker", lambda n: kill if n == 0 else [], 2 if o["kill"] else 1, params=params)
        spawns.prepare(spawns.limit)
        stream = names.stream(STREAM)
        window = {} if o["window"] is None else {"duplicate_window": o["window"]}
        await lab.js.add_stream(name=stream, subjects=[names.subject(SUBJECT)], **window)
        dlq_info = await lab.js.add_stream(name=names.stream(DLQ_STREAM), subjects=[names.subject(DLQ_SUBJECT)])
        config = ConsumerConfig(
            durable_name=names.durable(DURABLE), ack_policy=AckPolicy.EXPLICIT, ack_wait=o["ack_wait"],
            max_deliver=o["max_deliver"], max_ack_pending=o["max_ack_pending"],
            backoff=list(o["backoff"]) if o["backoff"] else None,
        )  # fmt: skip
        await lab.js.add_consumer(stream, config)
        consumer = (await lab.js.consumer_info(stream, names.durable(DURABLE))).config
        advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{names.durable(DURABLE)}"
        if o["copier"] is not None:
            await lab.js.add_stream(name=names.stream(ADVISORY_STREAM), subjects=[advisory])
            await lab.js.add_consumer(
                names.stream(ADVISORY_STREAM),
                ConsumerConfig(durable_name=names.durable(ADVISORY_DURABLE), ack_policy=AckPolicy.EXPLICIT),
            )
        subs = [await lab.nc.subscribe(advisory, cb=self._on_exhausted)]
        # The provider: what is wrong with which email, from a clean slate.
        await bench.provider.control(bench.nc, "reset")
        for op, args in er.breaks(self.plan):
            await bench.provider.control(bench.nc, op, **args)
        await asyncio.gather(*spawns.waiting)  # up and held: starting them costs the experiment no time
        if o["copier"] is not None:
            await lab.spawn("copier", params={"copier": o["copier"].__name__})
        self.t0 = time.time()
        if o["outage"]:
            # From the first request: publishing and starting the worker must not use up the outage.
            await bench.provider.outage(bench.nc, o["outage"], from_next_request=True)
            self.row("outage", "", seconds=o["outage"])
        seqs: dict[int, str] = {}
        for email in self.plan:
            ts = time.time()
            ack = await lab.js.publish(names.subject(SUBJECT), email.payload, headers=email.headers)
            seqs[int(ack.seq)] = email.order
            self.row("published", email.order, ts, seq=int(ack.seq))
        first = await spawns.release()
        started = time.time()  # the experiment's length counts from here: publishing under load must not eat it
        deadline = time.monotonic() + o["timeout"]
        if o["kill"]:
            await lab.wait_for(lambda: first is None or not first.alive, o["timeout"])
            await spawns.release()  # the second worker takes over
        if o["seconds"] is not None:
            await asyncio.sleep(max(0.0, started + o["seconds"] - time.time()))  # the experiment's length
            self.row("end", "")  # the queue's age runs to here, not to the last thing a worker did
        else:
            await lab.wait_for(lambda: self._settled(seqs, o), max(0.1, deadline - time.monotonic()))
        if o["redrive"] is not None:
            await self._redrive(o, seqs, deadline)
        info = await lab.js.consumer_info(stream, names.durable(DURABLE))
        stream_state = (await lab.js.stream_info(stream)).state
        dlq = await _read(lab.js, names.stream(DLQ_STREAM))
        for sub in subs:
            await sub.unsubscribe()
        self._collect(seqs)
        if os.environ.get("MSGLAB_DEBUG_DEMO"):
            print("\n".join(lab.output_tail()), [(c.role, c.how_it_ended()) for c in lab.children], file=sys.stderr)
            print([(e.kind, e.name, e.key, e.detail) for e in lab.log.events()][:20], file=sys.stderr)
        return Result(
            handler=handler.__name__, emails=[e.order for e in self.plan], rows=sorted(self.rows, key=lambda r: r.t),
            dlq=[DeadLetter.of(raw) for raw in dlq], consumer=consumer, pending=int(info.num_pending),
            ack_pending=int(info.num_ack_pending), stored=int(stream_state.messages),
            dlq_window=float(dlq_info.config.duplicate_window or 0), seconds=time.perf_counter() - o["started"],
        )  # fmt: skip

    def _serve_effects(self) -> None:
        bench = self.bench

        async def send_email(child: Child, key: str | None, detail: dict[str, Any], call: int) -> Any:
            from msglab.grading.harness import Refuse

            ts = time.time()
            answer = await er.forward(bench.nc, bench.provider.subject, key or "", detail)
            self.row("attempt", key or "", ts, status=answer.status, text=answer.text, pid=child.pid)
            if answer.error:
                raise Refuse(answer.error, answer.text)
            return answer.text

        async def dead_letter(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
            self.row("dead_letter", key or "", pid=child.pid, **detail)

        self.lab.on("send_email", send_email)
        self.lab.on("dead_letter", dead_letter)

    async def _on_exhausted(self, msg: Any) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            self.exhausted.setdefault(int(json.loads(msg.data)["stream_seq"]), time.time())

    def _settled(self, seqs: dict[int, str], o: dict[str, Any]) -> bool:
        """Every email acked or termed, or out of deliveries; with a copier, every exhausted one copied."""
        done = {
            e.detail.get("seq") for e in self.lab.log.events("note", "settle") if e.detail.get("how") in ("ack", "term")
        }
        left = [seq for seq in seqs if seq not in done and seq not in self.exhausted]
        notes = self.lab.log.events("note")
        busy = any(
            [e.name for e in notes if e.pid == w.pid].count("delivery")
            != [e.name for e in notes if e.pid == w.pid].count("handled")
            for w in self.lab.children
            if w.alive and w.role == "worker"
        )
        stored = sum(r.kind == "dead_letter" and not r.detail.get("duplicate") for r in self.rows)
        copied = o["copier"] is None or stored >= len(self.exhausted)
        return not left and not busy and copied

    async def _redrive(self, o: dict[str, Any], seqs: dict[int, str], deadline: float) -> None:
        bench, lab = self.bench, self.lab
        for op, args in er.fixes([email for email in self.plan if email.order in o["fix"]]):
            await bench.provider.control(bench.nc, op, **args)
        self.row("fixed", ",".join(o["fix"]))
        env = RedriveEnv(lab)
        for number in range(1, o["redrive_runs"] + 1):
            if number > 1 and o["redrive_gap"]:
                await asyncio.sleep(o["redrive_gap"])  # the experiment: the rerun comes this much later
            before = int((await lab.js.stream_info(lab.names.stream(STREAM))).state.last_seq)
            await o["redrive"](env, list(o["fix"]))
            after = int((await lab.js.stream_info(lab.names.stream(STREAM))).state.last_seq)
            for raw in await _read(lab.js, lab.names.stream(STREAM), before + 1, after):
                order = dict(raw.headers or {}).get("Order-Id", "?")
                seqs[int(raw.seq)] = order
                self.row("redriven", order, seq=int(raw.seq), run=number)
            self.row("redrive_run", "", run=number, stored=after - before)
            await lab.wait_for(lambda: self._settled(seqs, o), max(0.1, deadline - time.monotonic()))

    def _collect(self, seqs: dict[int, str]) -> None:
        for e in self.lab.log.events("note"):
            if e.name in ("delivery", "settle"):
                self.row(e.name, e.key or "", e.ts, pid=e.pid, **e.detail)
        for e in self.lab.log.events("crash"):
            self.row("kill", e.key or "", e.ts, pid=e.pid)
        for seq, ts in self.exhausted.items():
            self.row("exhausted", seqs.get(seq, "?"), ts, seq=seq)
        for email in self.bench.provider.sent():  # what the recipients got, whatever the workers were told
            if email.ts >= self.since:
                self.row("email", email.order_id or "", email.ts, message_id=email.message_id)


class RedriveEnv:
    """What a cell's redrive function gets: JetStream and the run's names (as a worker's env has them)."""

    def __init__(self, lab: Run) -> None:
        self.js, self.nc, self.names = lab.js, lab.nc, lab.names
        self.dlq_stream = lab.names.stream(DLQ_STREAM)
        self.dlq_subject = lab.names.subject(DLQ_SUBJECT)
        self.stream = lab.names.stream(STREAM)
        self.subject = lab.names.subject(SUBJECT)


async def _read(js: Any, stream: str, first: int = 1, last: int | None = None) -> list[Any]:
    if last is None:
        last = int((await js.stream_info(stream)).state.last_seq)
    found = []
    for seq in range(first, last + 1):
        with contextlib.suppress(Exception):
            found.append(await js.get_msg(stream, seq))
    return found


# --- what a run did ----------------------------------------------------------------------------


@dataclass
class DeadLetter:
    """One message in the DLQ stream."""

    seq: int
    order: str
    reason: str
    deliveries: str
    stream_seq: str
    headers: dict[str, str]

    @classmethod
    def of(cls, raw: Any) -> DeadLetter:
        headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
        return cls(
            int(raw.seq), headers.get("Order-Id", "?"), headers.get("Dlq-Reason", ""),
            headers.get("Dlq-Deliveries", ""), headers.get("Dlq-Stream-Seq", ""), headers,
        )  # fmt: skip


@dataclass
class Result:
    """One run: every delivery, settle, provider answer, dead letter and kill, with the run's clock."""

    handler: str
    emails: list[str]
    rows: list[Row]
    dlq: list[DeadLetter]
    consumer: Any  # the durable's config as the server reports it
    pending: int  # messages the durable has not delivered yet, at the end
    ack_pending: int  # delivered and not settled, at the end
    stored: int  # messages in the email stream at the end
    dlq_window: float  # the DLQ stream's duplicate window, seconds
    seconds: float

    def _of(self, kind: str, order: str | None = None) -> list[Row]:
        return [r for r in self.rows if r.kind == kind and (order is None or r.order == order)]

    def deliveries(self, order: str) -> int:
        """How many times the server delivered this order's email."""
        return len(self._of("delivery", order))

    def times(self, order: str) -> list[float]:
        return [r.t for r in self._of("delivery", order)]

    def gaps(self, order: str) -> list[float]:
        """Seconds between consecutive deliveries of this order's email."""
        t = self.times(order)
        return [round(b - a, 3) for a, b in itertools.pairwise(t)]

    def span(self, order: str) -> float:
        """Seconds from this email's first delivery to its last."""
        t = self.times(order)
        return t[-1] - t[0] if t else 0.0

    def per_second(self, order: str) -> float:
        t = self.times(order)
        return len(t) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float(len(t))

    def answers(self, order: str) -> Counter[int]:
        """The provider's answers to this order's email, by status (200: sent)."""
        return Counter(int(r.detail.get("status", 0)) for r in self._of("attempt", order))

    @property
    def sent(self) -> Counter[str]:
        """Emails the provider sent, by order, as its store holds them (an answer lost to a reset included)."""
        return Counter(r.order for r in self._of("email"))

    def sent_after(self, t: float) -> Counter[str]:
        return Counter(r.order for r in self._of("email") if r.t >= t)

    @property
    def exhausted(self) -> list[str]:
        """Orders the server stopped delivering (max_deliver reached)."""
        return [r.order for r in self._of("exhausted")]

    @property
    def kills(self) -> int:
        return len(self._of("kill"))

    @property
    def duplicates(self) -> int:
        """Dead letters the DLQ stream answered with 'duplicate' (Nats-Msg-Id seen before): not stored again."""
        return sum(bool(r.detail.get("duplicate")) for r in self._of("dead_letter"))

    def dlq_count(self, order: str) -> int:
        return sum(d.order == order for d in self.dlq)

    def settles(self, order: str) -> list[str]:
        """What the handler answered to each delivery: 'nak 0.05', 'term', 'ack'."""
        out = []
        for r in self._of("settle", order):
            delay = r.detail.get("delay")
            out.append(f"{r.detail.get('how')} {delay:g}" if delay else str(r.detail.get("how")))
        return out

    def gaps_table(self, order: str, asked: Sequence[float] | None = None) -> Table:
        """Each redelivery of one email: the wait measured between deliveries, and the wait configured."""
        rows = []
        for i, gap in enumerate(self.gaps(order)):
            row: list[Any] = [f"#{i + 1} -> #{i + 2}", f"{gap:.3f} s"]
            if asked is not None:
                row.append(f"{asked[min(i, len(asked) - 1)]:.3f} s")
            rows.append(row)
        head = ["deliveries", "measured wait"] + (["configured"] if asked is not None else [])
        return Table(head, rows)

    def finished(self) -> dict[str, float]:
        """When each email was finished for good: acked, termed, or out of deliveries (run clock)."""
        done: dict[str, float] = {}
        for r in self.rows:
            if (r.kind == "settle" and r.detail.get("how") in ("ack", "term")) or r.kind == "exhausted":
                done.setdefault(r.order, r.t)
        return done

    def queue_ages(self, step: float = 0.05) -> list[tuple[float, float]]:
        """Every `step` s, the queue age: how long the oldest unfinished email (waiting, or held by a worker
        without an ack) had waited since the stream stored it."""
        stored = {r.order: r.t for r in self._of("published")}
        done = self.finished()
        end = max((r.t for r in self.rows), default=0.0)
        ages, t = [], 0.0
        while t <= end + 1e-9:
            open_ = [p for o, p in stored.items() if p <= t and done.get(o, float("inf")) > t]
            ages.append((round(t, 3), round(t - min(open_), 3) if open_ else 0.0))
            t += step
        return ages

    def max_queue_age(self) -> float:
        return max((age for _, age in self.queue_ages()), default=0.0)

    def first_behind(self, poison: str) -> float | None:
        """How long the first email behind `poison` waited for a worker (None: no worker took any)."""
        published = {r.order: r.t for r in self._of("published") if r.order != poison}
        taken = [
            r.t - published[r.order] for r in self.rows if r.kind in ("attempt", "settle") and r.order in published
        ]
        return round(min(taken), 3) if taken else None

    def emails_behind_sent(self, poison: str) -> int:
        return sum(n > 0 for order, n in self.sent.items() if order != poison)

    def dlq_table(self) -> Table:
        rows = [[d.seq, d.order, d.deliveries, d.stream_seq, _short(d.reason, 70)] for d in self.dlq]
        return Table(["DLQ seq", "order", "Dlq-Deliveries", "Dlq-Stream-Seq", "Dlq-Reason"], rows)

    def where(self, order: str) -> str:
        """Where one email is at the end of the run, in a sentence."""
        n = self.deliveries(order)
        said = [f"{order}: delivered {n} times"]
        if order in self.exhausted:
            said.append("then the server stopped (max_deliver) and published one MAX_DELIVERIES advisory")
        said.append(f"the stream still holds it ({self.stored} message(s) in all)")
        said.append(f"the durable shows {self.pending} waiting and {self.ack_pending} unacked")
        said.append(f"the DLQ holds {self.dlq_count(order)} copy(ies) of it")
        return "; ".join(said)

    def ended(self, order: str) -> str:
        """Where one email ended: sent, in the DLQ, out of deliveries, termed, or still waiting."""
        if self.sent[order]:
            return "sent"
        if self.dlq_count(order):
            return "in the DLQ"
        if order in self.exhausted:
            return "out of deliveries"
        return "termed" if "term" in self.settles(order) else "still retrying"

    def summary(self) -> Table:
        """One row per email: deliveries, the provider's answers, the emails it sent, where it ended."""
        rows = []
        for spec in self.emails:
            answers = ", ".join(f"{k if k else 'reset'}×{v}" for k, v in sorted(self.answers(spec).items()))
            rows.append([spec, self.deliveries(spec), answers or "-", self.sent[spec], self.ended(spec)])
        return Table(["order", "deliveries", "provider answered", "emails sent", "ended"], rows)

    def __repr__(self) -> str:
        sent, dead = sum(self.sent.values()), len(self.dlq)
        return f"<{self.handler}: {len(self.emails)} emails, {sent} sent, {dead} in the DLQ, {self.seconds:.1f} s>"


def compare(transient: str, permanent: str, **runs: Result) -> Table:
    """Policies side by side: what became of the transient email, and what the permanent one cost."""
    rows = []
    for label, r in runs.items():
        first5 = r.times(transient)[:5]
        rows.append([
            label, r.ended(transient), f"{first5[-1] - first5[0]:.3f} s" if len(first5) > 1 else "-",
            r.deliveries(permanent), f"{r.span(permanent):.2f} s", r.ended(permanent),
        ])  # fmt: skip
    head = [
        "policy", f"{transient}", "its first 5 deliveries span", f"{permanent}: deliveries",
        "from first to last", "ended",
    ]  # fmt: skip
    return Table(head, rows)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plot_queue_ages(**runs: Result) -> Any:
    """The queue age over time (the oldest email not yet acked or termed), one line per run."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    for label, result in runs.items():
        ages = result.queue_ages()
        ax.plot([t for t, _ in ages], [a for _, a in ages], label=label)
    ax.set_xlabel("seconds since the emails were published")
    ax.set_ylabel("queue age (s)")
    ax.set_title("queue age: the oldest email not yet acked, termed or out of deliveries", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# --- small facts, checked on the lesson's own server ------------------------------------------------


async def consumer_rules(js: Any, delays: Sequence[float]) -> Table:
    """What the server does with a backoff list: the ack_wait it reports, and which max_deliver it refuses."""
    from nats.js.api import AckPolicy, ConsumerConfig
    from nats.js.errors import BadRequestError

    from msglab.broker import delete_stream

    await delete_stream(js, PROBE_STREAM)
    await js.add_stream(name=PROBE_STREAM, subjects=["lesson04.probe"])
    rows = []
    try:
        for max_deliver in (len(delays) + 1, len(delays), len(delays) - 1):
            config = ConsumerConfig(
                durable_name=f"probe{max_deliver}", ack_policy=AckPolicy.EXPLICIT, ack_wait=30,
                backoff=list(delays), max_deliver=max_deliver,
            )  # fmt: skip
            try:
                info = await js.add_consumer(PROBE_STREAM, config)
                rows.append([max_deliver, "accepted", f"ack_wait {info.config.ack_wait:g} s (asked 30 s)"])
            except BadRequestError as exc:
                rows.append([max_deliver, "refused", f"{exc.err_code}: {exc.description}"])
    finally:
        await delete_stream(js, PROBE_STREAM)
    return Table([f"max_deliver, backoff of {len(delays)}", "the server", "what it says"], rows)


async def durable_defaults(js: Any) -> dict[str, Any]:
    """What the server fills in for a durable made with nothing but a name and explicit acks."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from msglab.broker import delete_stream

    await delete_stream(js, PROBE_STREAM)
    await js.add_stream(name=PROBE_STREAM, subjects=["lesson04.probe"])
    try:
        info = await js.add_consumer(PROBE_STREAM, ConsumerConfig(durable_name="plain", ack_policy=AckPolicy.EXPLICIT))
    finally:
        await delete_stream(js, PROBE_STREAM)
    c = info.config
    return {
        "max_deliver": c.max_deliver,
        "ack_wait": c.ack_wait,
        "backoff": c.backoff,
        "max_ack_pending": c.max_ack_pending,
    }


@dataclass(frozen=True)
class Advisories:
    """MAX_DELIVERIES advisories seen for one email that ran out of deliveries, by kind of durable."""

    pull_idle: int  # a pull durable, its last ack_wait over for 0.3 s, nobody fetching
    pull_fetched: int  # the same, after one fetch that got nothing
    push: int  # a push durable: nobody ever fetches

    def __repr__(self) -> str:
        return (
            f"pull durable, nobody fetching: {self.pull_idle}; after one fetch: {self.pull_fetched}; "
            f"push durable, nobody fetching: {self.push}"
        )


async def advisories_by_kind(nc: Any) -> Advisories:
    """An email runs out of deliveries (max_deliver 2, ack_wait 0.1 s, never acked) on a pull and a push durable;
    `nc` also takes the push deliveries, and hears the advisories."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from msglab.broker import delete_stream

    js = nc.jetstream()
    await delete_stream(js, PROBE_STREAM)
    await js.add_stream(name=PROBE_STREAM, subjects=["lesson04.probe.>"])
    seen: list[str] = []  # the consumer each advisory names
    pushed = asyncio.Event()

    async def on_advisory(msg: Any) -> None:
        seen.append(str(json.loads(msg.data).get("consumer")))
        if seen[-1] == "push":
            pushed.set()

    subs = [await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{PROBE_STREAM}.>", cb=on_advisory)]
    try:

        def rules(name: str, **more: Any) -> Any:
            return ConsumerConfig(
                durable_name=name, filter_subject=f"lesson04.probe.{name}", ack_policy=AckPolicy.EXPLICIT,
                ack_wait=0.1, max_deliver=2, **more,
            )  # fmt: skip

        await js.add_consumer(PROBE_STREAM, rules("pull"))
        box = nc.new_inbox()
        subs.append(await nc.subscribe(box))  # takes the push deliveries and never acks them
        await js.add_consumer(PROBE_STREAM, rules("push", deliver_subject=box))
        await js.publish("lesson04.probe.push", b"o-1042")
        await js.publish("lesson04.probe.pull", b"o-1042")
        sub = await js.pull_subscribe_bind("pull", PROBE_STREAM)
        for _ in range(2):
            await sub.fetch(1, timeout=2)  # deliveries 1 and 2, never acked
        with contextlib.suppress(TimeoutError):  # the push durable's advisory: at once, or late on a loaded machine
            await asyncio.wait_for(pushed.wait(), 5)
        await asyncio.sleep(0.4)  # the experiment: the pull durable's last ack_wait (0.1 s) runs out, nobody fetches
        pull_idle = seen.count("pull")
        with contextlib.suppress(TimeoutError):
            await sub.fetch(1, timeout=0.3)  # one pull request waits; nothing is delivered
        await sub.unsubscribe()
        return Advisories(pull_idle, seen.count("pull"), seen.count("push"))
    finally:
        for s in subs:
            await s.unsubscribe()
        await delete_stream(js, PROBE_STREAM)


@dataclass(frozen=True)
class HeldSlot:
    """What the next fetch returned after a delayed nak, on a durable with max_ack_pending=1."""

    data: str
    delivery: int
    seconds: float  # from the nak to that delivery
    delay: float

    def __repr__(self) -> str:
        return (
            f"nak(delay={self.delay:g}) on the first order; the next fetch returned {self.data!r} "
            f"(delivery {self.delivery}) {self.seconds:.2f} s later"
        )


async def nak_keeps_its_slot(js: Any, delay: float = 1.0) -> HeldSlot:
    """Two orders on a durable with max_ack_pending=1: nak the first with a delay, then fetch the next."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from msglab.broker import delete_stream

    await delete_stream(js, PROBE_STREAM)
    await js.add_stream(name=PROBE_STREAM, subjects=["lesson04.probe"])
    try:
        config = ConsumerConfig(durable_name="one", ack_policy=AckPolicy.EXPLICIT, ack_wait=10, max_ack_pending=1)
        await js.add_consumer(PROBE_STREAM, config)
        for order in ("o-1042", "o-2001"):
            await js.publish("lesson04.probe", order.encode())
        sub = await js.pull_subscribe_bind("one", PROBE_STREAM)
        [first] = await sub.fetch(1, timeout=2)
        naked = time.monotonic()
        await first.nak(delay=delay)
        [after] = await sub.fetch(1, timeout=delay + 5)
        seconds = time.monotonic() - naked
        await after.ack_sync()
        await sub.unsubscribe()
        return HeldSlot(after.data.decode(), int(after.metadata.num_delivered), seconds, delay)
    finally:
        await delete_stream(js, PROBE_STREAM)


# --- a computation, not a measurement: more clients than one machine runs --------------------------


def return_after_outage(
    clients: int = 1000, outage: float = 10.0, delays: Sequence[float] = (1, 2, 4, 8, 16), seed: int = 4
) -> Table:
    """`clients` requests all fail at second 0, when an outage of `outage` seconds begins; each retries on
    `delays`. The requests that reach the provider in its busiest 100 ms once it is back, per policy."""
    import random

    rnd = random.Random(seed)
    policies: dict[str, Callable[[int], float]] = {
        "backoff": lambda n: delays[min(n, len(delays) - 1)],
        "Retry-After: 10 (once)": lambda n: outage if n == 0 else delays[min(n, len(delays) - 1)],
        "backoff with jitter": lambda n: delays[min(n, len(delays) - 1)] * rnd.uniform(0.5, 1.5),
        "Retry-After: 10, plus jitter": lambda n: (
            (outage if n == 0 else delays[min(n, len(delays) - 1)]) * rnd.uniform(1.0, 1.5)
        ),
    }
    rows = []
    for name, wait in policies.items():
        arrivals = []
        for _ in range(clients):
            t, n = 0.0, 0
            while t < outage:  # each try inside the outage fails; the first one after it goes through
                t += wait(n)
                n += 1
            arrivals.append(t)
        buckets = Counter(int(a * 10) for a in arrivals)  # 100 ms buckets
        rows.append([name, max(buckets.values()), f"{min(arrivals):.1f}-{max(arrivals):.1f} s"])
    return Table(["policy", "busiest 100 ms after the return", f"the {clients} retries arrived"], rows)


# --- nak() and term() only fill a buffer, like ack() ----------------------------------------------

SETTLE_SUBJECT = "lesson04.probe.settle"


async def _until(condition: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> bool:
    """Wait until `condition()` holds (asked every 10 ms), at most `timeout` seconds; return whether it did."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _settle_probe(js: Any, durables: Sequence[str], ack_wait: float) -> None:
    """A fresh probe stream with one durable per name, each filtered to its own subject holding o-1042."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from msglab.broker import delete_stream

    await delete_stream(js, PROBE_STREAM)
    await js.add_stream(name=PROBE_STREAM, subjects=[f"{SETTLE_SUBJECT}.>"])
    for durable in durables:
        config = ConsumerConfig(
            durable_name=durable, filter_subject=f"{SETTLE_SUBJECT}.{durable}", ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
        )  # fmt: skip
        await js.add_consumer(PROBE_STREAM, config)
        await js.publish(f"{SETTLE_SUBJECT}.{durable}", b"o-1042")


async def _offered_now(nc: Any, durable: str) -> int:
    """The delivery number a fetch that does not wait gets now (0: the server offers nothing)."""
    request = json.dumps({"batch": 1, "no_wait": True}).encode()
    reply = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{PROBE_STREAM}.{durable}", request, timeout=5)
    return int(reply.metadata.num_delivered) if reply.reply else 0  # a 404 status has no ack subject


async def _unacked(js: Any, durable: str) -> int:
    return int((await js.consumer_info(PROBE_STREAM, durable)).num_ack_pending)


async def _none_unacked(js: Any, durable: str) -> bool:
    return await _unacked(js, durable) == 0


def _look_from_another_thread(url: str, durable: str) -> tuple[int, int]:
    """(unacked, offered) asked on a connection of another thread, blocking the caller's event loop meanwhile:
    the caller's connection cannot write its buffer until this returns."""
    from concurrent.futures import ThreadPoolExecutor

    from msglab.broker import connect

    async def look() -> tuple[int, int]:
        nc = await connect(url, name="lesson04-observer")
        try:
            return await _unacked(nc.jetstream(), durable), await _offered_now(nc, durable)
        finally:
            await nc.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, look()).result(timeout=30)


@dataclass(frozen=True)
class Buffered:
    """One settle call on o-1042, and what the server knew right after it returned and after a flush."""

    call: str  # "nak()" or "term()"
    bytes_buffered: int  # in the connection's outgoing buffer when the call returned
    unacked_before: int  # num_ack_pending, asked before the worker's event loop ran again
    offered_before: int  # the delivery a fetch got then (0: nothing)
    unacked_after: int  # after `await nc.flush()`, once the server acted on it
    offered_after: int


@dataclass
class BufferedSettles:
    """nak() and term() on a durable (ack_wait 30 s): the server right after each call, and after a flush."""

    rows: list[Buffered]

    def table(self) -> Table:
        def said(unacked: int, offered: int) -> str:
            return f"{unacked} unacked; a fetch gets " + (f"o-1042 (delivery {offered})" if offered else "nothing")

        head = ["the worker called", "bytes left in its buffer", "the server right after", "after await nc.flush()"]
        return Table(head, [
            [r.call, r.bytes_buffered, said(r.unacked_before, r.offered_before), said(r.unacked_after, r.offered_after)]
            for r in self.rows
        ])  # fmt: skip

    def __getitem__(self, call: str) -> Buffered:
        return next(r for r in self.rows if r.call == call)

    def __repr__(self) -> str:
        return repr(self.table())

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


async def settles_in_the_buffer(url: str | None = None) -> BufferedSettles:
    """Fetch o-1042 on a worker connection, nak() it (term() it on a second durable), then ask the server from
    another connection before the worker's event loop runs again; then `await nc.flush()` and ask again."""
    from msglab.broker import connect, delete_stream, server_url

    url = url or server_url()
    worker = await connect(url, name="lesson04-worker")
    observer = await connect(url, name="lesson04-observer")
    js = observer.jetstream()
    rows = []
    try:
        await _settle_probe(js, ["nak", "term"], ack_wait=30)  # no redelivery by timer during the experiment
        for how in ("nak", "term"):
            sub = await worker.jetstream().pull_subscribe_bind(how, PROBE_STREAM)
            [msg] = await sub.fetch(1, timeout=10)
            await getattr(msg, how)()
            buffered = int(getattr(worker, "_pending_data_size", -1))  # nats-py's outgoing buffer
            unacked_before, offered_before = _look_from_another_thread(url, how)
            await worker.flush()
            if how == "term":  # the server acts on a settle a moment after reading it
                await _until(partial(_none_unacked, js, how))
                unacked_after, offered_after = await _unacked(js, how), await _offered_now(observer, how)
            else:  # a nak without a delay: offered again at once, so a waiting fetch gets it
                unacked_after = await _unacked(js, how)
                [again] = await (await js.pull_subscribe_bind(how, PROBE_STREAM)).fetch(1, timeout=10)
                offered_after = int(again.metadata.num_delivered)
            await sub.unsubscribe()
            rows.append(Buffered(f"{how}()", buffered, unacked_before, offered_before, unacked_after, offered_after))
        return BufferedSettles(rows)
    finally:
        await delete_stream(js, PROBE_STREAM)
        await worker.close()
        await observer.close()


# A worker process: fetch o-1042, settle it, maybe flush, and SIGKILL itself before its event loop runs again.
_SETTLE_AND_DIE = """
import asyncio, os, signal, sys, time
import nats

async def main():
    stream, durable, how, flush, delay = sys.argv[1:6]
    nc = await nats.connect(os.environ["MSGLAB_SETTLE_URL"], name="lesson04-doomed-worker")
    sub = await nc.jetstream().pull_subscribe_bind(durable, stream)
    [msg] = await sub.fetch(1, timeout=30)
    print(time.time(), flush=True)  # when o-1042 was delivered
    await (msg.nak(delay=float(delay)) if float(delay) else getattr(msg, how)())
    if flush == "flush":
        await nc.flush()
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


@dataclass(frozen=True)
class Killed:
    """A worker process that settled o-1042 and was SIGKILLed on the next line; what the server did next."""

    did: str  # "term()", "term(), flush()", "nak(delay=3)"
    exit_signal: int  # 9: SIGKILL
    unacked: int  # num_ack_pending once the process was gone (and the server had acted on what reached it)
    deliveries: int  # o-1042's deliveries in all
    seconds: float | None  # from its first delivery to the next (None: it never came back)


@dataclass
class KilledAfterSettling:
    """Workers killed right after a settle call, with and without a flush first."""

    rows: list[Killed]
    ack_wait: float

    def deliveries(self, did: str) -> int:
        return next(r.deliveries for r in self.rows if r.did == did)

    def __getitem__(self, did: str) -> Killed:
        return next(r for r in self.rows if r.did == did)

    def table(self) -> Table:
        def then(r: Killed) -> str:
            if r.seconds is None:
                return "nothing more: o-1042 is finished"
            return f"delivered o-1042 again (delivery {r.deliveries}) {r.seconds:.2f} s after the first"

        head = ["the worker, then SIGKILL", "unacked after the kill", f"the server (ack_wait {self.ack_wait:g} s)"]
        return Table(head, [[r.did, r.unacked, then(r)] for r in self.rows])

    def __repr__(self) -> str:
        return repr(self.table())

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()


async def settle_then_kill(url: str | None = None, ack_wait: float = 1.0, delay: float = 3.0) -> KilledAfterSettling:
    """Six worker processes, each on a durable of its own: fetch o-1042; nak(), nak(delay=delay) or term() it,
    with or without `await nc.flush()`; SIGKILL. Then what the server holds and whether, and when, o-1042 comes
    back; another worker acks it if it does."""
    from msglab.broker import connect, delete_stream, server_url

    url = url or server_url()
    plans = {
        "nak": ("nak", "", 0.0), "nak_flush": ("nak", "flush", 0.0),
        "nak_delay": ("nak", "", delay), "nak_delay_flush": ("nak", "flush", delay),
        "term": ("term", "", 0.0), "term_flush": ("term", "flush", 0.0),
    }  # fmt: skip
    nc = await connect(url, name="lesson04-observer")
    js = nc.jetstream()
    try:
        await _settle_probe(js, list(plans), ack_wait=ack_wait)
        return KilledAfterSettling(
            list(await asyncio.gather(*(_kill_one(url, js, d, *p) for d, p in plans.items()))), ack_wait
        )
    finally:
        await delete_stream(js, PROBE_STREAM)
        await nc.close()


async def _kill_one(url: str, js: Any, durable: str, how: str, flush: str, delay: float) -> Killed:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SETTLE_AND_DIE, PROBE_STREAM, durable, how, flush, str(delay),
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "MSGLAB_SETTLE_URL": url},
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    if proc.returncode is None or proc.returncode >= 0 or not out.strip():
        raise RuntimeError(f"the worker for {durable} ended with {proc.returncode}, not a SIGKILL after a delivery")
    delivered = float(out.split()[0])
    did = (f"nak(delay={delay:g})" if delay else f"{how}()") + (", flush()" if flush else "")
    # A term that reached the server finishes o-1042 a moment later; if it is still unacked, it comes back.
    if how == "term" and flush and await _until(partial(_none_unacked, js, durable), timeout=5):
        return Killed(did, -proc.returncode, 0, 1, None)
    unacked = await _unacked(js, durable)
    sub = await js.pull_subscribe_bind(durable, PROBE_STREAM)
    [again] = await sub.fetch(1, timeout=30)  # waits for the redelivery, whenever the server makes it
    seconds = time.time() - delivered
    await again.ack_sync()
    await sub.unsubscribe()
    return Killed(did, -proc.returncode, unacked, int(again.metadata.num_delivered), seconds)
