"""Lab 04 grader: an email worker that retries what can succeed, dead-letters what never will, and a redrive.

Workload (seeded), 13 email requests on `orders.email` (stream EMAILS, durable 'email': max_deliver
5, ack_wait 0.3 s), each with `Order-Id` and `Correlation-Id` headers, sent through the course's
email provider (msglab.world.email_provider, served from the grader's process over NATS, its own
store). The provider fails in ways the learner must judge from its errors alone: 503, 429 and a
reset connection (transient), 502 for a recipient's mail server that is down (transient, but for
longer than any retry budget), 422 for a mailbox that does not exist and 400 for a template not
deployed yet (permanent); one message's payload is cut off (not JSON: the learner's own code fails).

1. Worker #1 runs alone on 8 emails (3 ordinary, 2 the provider fails 1-2 times first, between them
   at least one 429, one 502 and one reset, a 422, a 400, the cut-off payload), two of the permanent ones
   among the first four. The DLQ stream
   refuses its first dead-letter publish (full, discard-new: a real refusal); it is SIGKILLed right
   after its first dead letter the DLQ stream confirmed, before that email is settled.
2. Worker #2 (started at once, then long-running) finishes what worker #1 left (redelivered after
   ack_wait). Then the provider goes down for 0.5 s (503); an email to a domain whose mail server
   stays down is published as it goes down, and four ordinary emails follow during the outage. None
   of them may wait long for a worker that holds another email to retry it. The DLQ stream refuses
   the first dead letter of the email whose mail server stays down, on whatever delivery it comes:
   for a worker that spends the whole budget, on the last, after which the server delivers it no more.
3. Once everything settled and the worker fetched again after an empty fetch, one more ordinary
   email is published: the worker running all along must send it (rule 2, `survives_idle`).
4. The causes of two dead emails are fixed (the template is deployed, the mail server is back) and
   the learner's redrive runs three times for those two orders: run 1 in a process SIGKILLed right
   after its first republish was stored, runs 2 and 3 in another process.

Evidence, all recorded out of the learner's reach: every delivery (the grader's copy of what the
server sends to the workers' inboxes), every ack/nak/term and its nak delay, the server's
MAX_DELIVERIES advisories (learner code may not publish on advisory subjects), every provider
request (the grader forwards it and the provider keeps its own store), every confirmed or refused
publish to the DLQ or back to `orders.email`, the kills, and the DLQ and EMAILS streams read at the
end. Which delivery a send or a publish belongs to is ordered by the worker's own note of each
fetched message, on the same channel as its calls, and counts only for deliveries the server sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from msglab.grading import rules
from msglab.grading.harness import Child, Refuse, Run
from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import refuse_publishes
from msglab.grading.rules import plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, Trace, gone, held
from msglab.grading.verdict import Check
from msglab.world import email_provider as ep
from msglab.world import email_requests as er
from msglab.world.email_provider import EmailApiError  # raised in the learner's processes

SUBJECT = "orders.email"
DLQ_SUBJECT = "orders.email.dlq"
ACK_WAIT = 0.5  # seconds; production uses 30 s or more
MAX_DELIVER = 5  # the retry budget: deliveries in all (a common production figure)
TOPOLOGY = Topology(
    stream="EMAILS", wildcard=SUBJECT, durable="email", subject=SUBJECT, ack_wait=ACK_WAIT,
    consumer={"max_deliver": MAX_DELIVER, "max_ack_pending": 100},
)  # fmt: skip
# The contract (msglab.grading.contract): what the learner's permissions protect and open.
STREAM, DURABLE = TOPOLOGY.stream, TOPOLOGY.durable
DLQ_STREAM = "EMAILS_DLQ"
STREAMS = (STREAM, DLQ_STREAM)  # every stream this grader creates (a shared server allows only these)
LEARNER_SUBJECTS = [SUBJECT, DLQ_SUBJECT]  # the redrive republishes, the worker dead-letters
LEARNER_DENY_PUBLISH = ["$JS.EVENT.>"]  # the server's advisories are evidence: learner code may not forge them
OUTAGE = 0.5  # seconds the provider is down (production outages last minutes)
MIN_RETRY = 0.1  # the README's shortest wait before a retry
HOT_GAP = 0.03  # a failed email delivered (or tried) again within this is retried "at once"
GROWTH = 2.0  # over a series of 3 or more retries, the last wait must be at least this many times the first
QUEUE_AGE_MAX = 0.35  # the longest an email may wait for a worker that holds another email to retry it
QUEUE_AGE_HARD = 2.0  # the longest an email may wait for a worker at all while the worker runs
# A worker that answers a failed delivery this long after the provider's answer sat out (part of) a wait itself.
# A lower bound with margin: an answering worker naks within milliseconds, a few tens of them on a busy machine.
# Judged on the worker's median over its failed deliveries: a sleeping handler sits out every one, while a
# loaded machine stalls an answering worker now and then (0.16 s once, under CI-like load).
SAT_OUT = 0.15
# The grader's own punctuality, checked every LATE_TICK: a wake-up later than LATE_SLACK is a spell in which
# every stamp the grader made came late (a busy machine; other graders' threads holding the GIL).
LATE_TICK = 0.02
LATE_SLACK = 0.01
FOLLOWERS = (0.0, 0.12, 0.24, 0.36)  # when the ordinary emails of phase 2 are published, after the outage began
STEP_WAIT = 2.5  # the longest worker #1 gets to reach its planned crash
FIRST_PULL = 2.0  # worker #2 must ask the broker for messages within this after its release
PHASE1_SETTLE = 4.0  # the longest worker #2 gets to finish the first emails before the outage
SETTLE = 6.0  # the longest the grader waits for every email to be settled (sent, dead, or out of deliveries)
IDLE_DEADLINE = 6.0  # the longest the grader waits to see the worker fetch again after an empty fetch (rule 2)
LATE_DEADLINE = 3.0  # the longest the running worker gets to send the late email (rule 2)
CALL_DEADLINE = 5.0  # a redrive call that has not returned by then is stopped
COPY_SETTLE = 3.0  # the longest redriven copies get to be handled

# The planned crashes, in the lab's words for rule 1 (rules.faults_check) should one not fire.
WORKER_CRASH = Crash(
    "dlq_published", 1, "after", point="right after the DLQ stream confirmed its first dead letter",
    counted="confirmed dead letter",
    hint=f"publish each email you give up on to {DLQ_SUBJECT} with JetStream and wait for the stream's confirmation"
    " (a core publish is never confirmed); when the DLQ refuses one, let the email come back and dead-letter it then",
)  # fmt: skip
REDRIVE_CRASH = Crash(
    "redrive_published", 1, "after", point=f"right after its first republish to {SUBJECT} was stored",
    counted="republished email",
    hint=f"republish the chosen dead emails to {SUBJECT} with JetStream, waiting for the stream's confirmation",
)  # fmt: skip

HEADERS = ("Order-Id", "Correlation-Id")  # what the shop's producer puts on every email request
REASON, DELIVERIES, STREAM_SEQ = "Dlq-Reason", "Dlq-Deliveries", "Dlq-Stream-Seq"  # the DLQ record's headers

PERMANENT = ("bounce", "template", "malformed")
DEAD = (*PERMANENT, "unreachable")  # what can never be sent within the budget
KIND_WORDS = {
    "ok": "an ordinary email",
    "flaky": "an email the provider fails {n} first",
    "bounce": "an email to a mailbox that does not exist (the provider answers 422)",
    "template": "an email whose template is not deployed yet (the provider answers 400)",
    "malformed": "a message whose payload is cut off (not JSON)",
    "unreachable": "an email to a domain whose mail server is down until the redrive (the provider answers 502)",
    "outage": "an ordinary email published while the provider was down (503 for {outage} s)",
    "late": "an ordinary email published once the worker had been idle",
}
NAMES = ("ana", "ben", "chloe", "dev", "eli", "farah", "gus", "hana", "ivo", "jun", "kai", "lena", "milo", "nora")
ANSWER_WORDS = {
    "429": "429 Too Many Requests",
    "502": "502 Bad Gateway",
    "503": "503 Service Unavailable",
    "reset": "a reset connection",
}


# --- what runs inside the learner's processes ------------------------------------------------


def _add_effects(env: Any) -> None:
    """Give env the provider's send call (an effect the grader answers) and watch DLQ and redrive publishes."""

    async def send_email(email: Any, idempotency_key: Any = None) -> str:
        if not isinstance(email, dict):
            raise TypeError(f"send_email takes the email as a dict (the parsed message), got {type(email).__name__}")
        detail = {"to": str(email.get("to")), "template": str(email.get("template"))}
        if idempotency_key is not None:  # lesson 04's keyed send: the provider sends a repeated key once
            detail["idempotency_key"] = str(idempotency_key)
        return env.world.call("send_email", str(email.get("order_id")), **detail)

    env.send_email = send_email
    env.EmailApiError = EmailApiError
    env.max_deliver = MAX_DELIVER
    _watch_publishes(env)


def transient_status(status: int) -> bool:
    """The provider's answer passes with time: 5xx, 429, or a reset connection (0); 200 is no failure."""
    return status == 0 or status == 429 or status >= 500


def _header(headers: Any, name: str) -> str | None:
    """A header's value, whatever case the publisher wrote its name in."""
    if not isinstance(headers, dict):
        return None
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == name.lower():
            return str(value)
    return None


def _order_of(payload: Any, headers: Any) -> str | None:
    """The order an email message is about: its Order-Id header, else the order_id in its payload."""
    found = _header(headers, "Order-Id")
    if found:
        return found
    try:
        body = json.loads(payload)
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return str(body["order_id"]) if isinstance(body, dict) and "order_id" in body else None


def _watch_publishes(env: Any) -> None:
    """Every JetStream publish to the DLQ or to orders.email, in this process, goes past the grader.

    Before a dead letter goes out the grader hears `dlq_publish` (it may make the DLQ stream refuse
    it); once the stream has confirmed it, `dlq_published` (it may SIGKILL the process there); a
    publish back to orders.email is `redrive_published` in a redrive process, `republished` in a
    worker. Patched on the class, so any JetStream context on any connection goes through it.
    """
    from nats.js.client import JetStreamContext

    dlq, main = env.subject(DLQ_SUBJECT), env.subject(SUBJECT)
    after_main = "redrive_published" if getattr(env, "role", "") == "redrive" else "republished"
    publish, publish_async = JetStreamContext.publish, JetStreamContext.publish_async
    sig, sig_async = inspect.signature(publish), inspect.signature(publish_async)

    def what(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None
        subject = bound.arguments.get("subject")
        if subject not in (dlq, main):
            return None
        payload, headers = bound.arguments.get("payload", b""), bound.arguments.get("headers")
        return {
            "dlq": subject == dlq,
            "key": _order_of(payload, headers),
            "stream_seq": _header(headers, STREAM_SEQ),
            "msg_id": _header(headers, "Nats-Msg-Id"),
        }

    def before(seen: dict[str, Any]) -> None:
        if seen["dlq"]:
            env.world.call("dlq_publish", seen["key"], stream_seq=seen["stream_seq"], msg_id=seen["msg_id"])

    def refused(seen: dict[str, Any], exc: BaseException) -> None:
        name = "dlq_refused" if seen["dlq"] else "main_refused"
        env.world.call(name, seen["key"], error=f"{type(exc).__name__}: {exc}"[:300])

    def after(seen: dict[str, Any], ack: Any) -> None:
        detail = {"seq": getattr(ack, "seq", None), "duplicate": bool(getattr(ack, "duplicate", False))}
        env.world.call("dlq_published" if seen["dlq"] else after_main, seen["key"], **detail, msg_id=seen["msg_id"])

    async def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = what(sig, (self, *args), kwargs)
        if seen is None:
            return await publish(self, *args, **kwargs)
        before(seen)
        try:
            ack = await publish(self, *args, **kwargs)
        except Exception as exc:
            refused(seen, exc)
            raise
        after(seen, ack)
        return ack

    async def watched_async(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = what(sig_async, (self, *args), kwargs)
        if seen is None:
            return await publish_async(self, *args, **kwargs)
        before(seen)
        future = await publish_async(self, *args, **kwargs)

        async def confirmed() -> Any:
            try:
                ack = await future
            except Exception as exc:
                refused(seen, exc)
                raise
            after(seen, ack)
            return ack

        return asyncio.ensure_future(confirmed())

    JetStreamContext.publish = watched  # type: ignore[method-assign]
    JetStreamContext.publish_async = watched_async  # type: ignore[method-assign]

    # Which delivery the process is handling when it asks the provider: a note on the same channel as the
    # send calls, so the grader knows their order. Used only to tell which delivery a send belongs to, and
    # only for deliveries the grader saw the server send.
    fetch = JetStreamContext.PullSubscription.fetch

    async def noted_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        msgs = await fetch(self, *args, **kwargs)
        for msg in msgs:
            with contextlib.suppress(Exception):
                meta = msg.metadata
                env.world.note("fetched", None, seq=meta.sequence.stream, n=meta.num_delivered)
        return msgs

    JetStreamContext.PullSubscription.fetch = noted_fetch  # type: ignore[method-assign]


async def role_email_worker(env: Any, learner: Any) -> None:
    """One email worker: waits held until the grader releases it, then runs the learner's loop."""
    env.role = "worker"
    _add_effects(env)
    held(env)
    await learner.email_worker(env)


def ops_redrive(env: Any, learner: Any) -> dict[str, Any]:
    """The redrive tool: the grader calls it with the orders whose cause was fixed."""
    env.role = "redrive"
    _add_effects(env)

    async def redrive(order_ids: list[str]) -> Any:
        result = await learner.redrive(env, list(order_ids))
        return result if isinstance(result, int | float | str | None) else repr(result)[:200]

    return {"redrive": redrive}


async def _provision(js: Any, names: Any) -> None:
    # The platform team's part: both streams and the durable exist before any learner code runs.
    await TOPOLOGY.provision(js, names)
    await js.add_stream(name=names.stream(DLQ_STREAM), subjects=[names.subject(DLQ_SUBJECT)])


async def playground(env: Any) -> None:
    """For the lab notebook: the streams and the durable, and an email provider of its own.

    `env.provider` is that provider: `env.provider.requests()` and `env.provider.sent()` read its
    store, `env.provider.behaviour` says what it does. Addresses at fjord.example are unreachable
    (502), anna@gmial.con does not exist (422), the template 'order_shipped_v2' is not deployed
    (400); `await env.provider.outage(env.nc, 0.5)` takes it down (503).
    """
    import atexit

    await _provision(env.js, env.names)
    folder = tempfile.mkdtemp(prefix="msglab-try04-")
    atexit.register(shutil.rmtree, folder, True)
    provider = await ep.attach(env.nc, os.path.join(folder, "provider.sqlite"), prefix=env.subject("provider"))
    provider.behaviour.missing_mailboxes.add(er.MISSING_MAILBOX)
    provider.behaviour.unreachable_domains.add(er.DOWN_DOMAIN)
    provider.behaviour.templates.discard(er.NEW_TEMPLATE)
    env.provider = provider
    env.EmailApiError = EmailApiError
    env.max_deliver = MAX_DELIVER

    async def send_email(email: Any, idempotency_key: Any = None) -> str:
        if not isinstance(email, dict):
            raise TypeError(f"send_email takes the email as a dict (the parsed message), got {type(email).__name__}")
        key = None if idempotency_key is None else str(idempotency_key)
        return await ep.send(env.nc, provider.subject, email, idempotency_key=key)

    env.send_email = send_email


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Email(er.EmailRequest):
    """One email request of the plan (msglab.world.email_requests: its kinds, payload and headers)."""

    phase: int = 1  # 1 or 2 (3: rule 2's late email)
    offset: float = 0.0  # phase 2: seconds after the outage began

    def words(self) -> str:
        said = KIND_WORDS[self.kind]
        if self.kind == "flaky":
            said = said.format(n=" then ".join(ANSWER_WORDS[a] for a in self.script))
        return said.format(outage=OUTAGE)

    @property
    def must_send(self) -> bool:
        return self.kind not in DEAD


@dataclass(frozen=True)
class Plan:
    emails: tuple[Email, ...]
    redrive: tuple[str, ...]  # the orders whose cause is fixed before the redrive
    late: Email  # rule 2's: published after the idle spell, judged only by survives_idle

    def phase(self, number: int) -> list[Email]:
        return [e for e in self.emails if e.phase == number]

    def get(self, order: str) -> Email:
        return next(e for e in self.emails if e.order == order)


def draw_plan(seed: int) -> Plan:
    """The workload, all from the seed: `--seed N` replays the same plan."""
    r = rng(seed, "emails")
    kinds = ["ok", "ok", "ok", "flaky", "flaky"]
    permanent = list(PERMANENT)
    r.shuffle(permanent)
    first = permanent[:2] + kinds[:2]  # two permanent emails among the first four: worker #1 meets both
    r.shuffle(first)
    rest = permanent[2:] + kinds[2:]
    r.shuffle(rest)
    phase1 = first + rest
    names = list(NAMES)
    r.shuffle(names)
    # Every seed meets every transient answer: a 429, a 502 and a reset in the two flaky emails' scripts (503
    # comes with the outage), so treating one of them as permanent fails on every seed, not on some of them.
    lengths = r.choice(((1, 2), (2, 1), (2, 2)))
    answers = ["429", "502", "reset", *(r.choice(("429", "502", "503", "reset")) for _ in range(sum(lengths) - 3))]
    r.shuffle(answers)
    scripts = [tuple(answers[: lengths[0]]), tuple(answers[lengths[0] :])]
    emails: list[Email] = []
    for kind in [*phase1, "unreachable", "outage", "outage", "outage", "outage"]:
        i = len(emails) + 1
        name = names.pop()
        template = er.NEW_TEMPLATE if kind == "template" else r.choice(("order_confirmation", "order_shipped"))
        script: tuple[str, ...] = ()
        if kind == "flaky":
            script = scripts.pop(0)
        phase = 1 if i <= len(phase1) else 2
        offset = FOLLOWERS[i - len(phase1) - 2] if kind == "outage" else 0.0
        correlation = f"corr-{r.getrandbits(32):08x}"
        emails.append(Email.make(f"o-{i:02d}", kind, name, template=template, script=script, phase=phase,
                                 offset=offset, correlation=correlation))  # fmt: skip
    redrive = tuple(e.order for e in emails if e.kind in ("template", "unreachable"))
    template = r.choice(("order_confirmation", "order_shipped"))  # drawn last: the emails above stay as they were
    late = Email.make(f"o-{len(emails) + 1:02d}", "late", names.pop(), template=template, phase=3,
                      correlation=f"corr-{r.getrandbits(32):08x}")  # fmt: skip
    return Plan(tuple(emails), redrive, late)


# --- the grader's side of the run --------------------------------------------------------------


@dataclass
class Msg:
    """One message in the EMAILS stream: an email of the plan, or a copy republished by the redrive."""

    seq: int
    email: Email
    published: float
    payload: bytes
    headers: dict[str, str]
    copy_run: int = 0  # 0 for the original; else the redrive run that stored this copy


@dataclass(frozen=True)
class Settle:
    ts: float
    kind: str  # ack, nak, term, progress
    n: int  # the delivery it answers
    delay: float | None = None  # a nak's delay, seconds


@dataclass(frozen=True)
class Attempt:
    ts: float
    pid: int
    order: str
    status: int  # 200 sent; the error status; 0 a reset connection
    text: str
    done: float = 0.0  # when the provider's answer was back (the learner's code has it a moment later)


@dataclass(frozen=True)
class Publish:
    """A publish to the DLQ or back to orders.email, as the learner's process reported it."""

    ts: float
    pid: int
    name: str  # dlq_publish, dlq_refused, dlq_published, redrive_published, republished, main_refused
    key: str | None
    detail: dict[str, Any]


class Lateness:
    """Spells in which the grader's own event loop ran late: the stamps it made in one (a call read, an ack
    seen) came late by up to the spell's length. A time that judges the learner's worker leaves them out,
    so the grader's lateness on a loaded machine is not counted as the worker's."""

    def __init__(self) -> None:
        self.spells: list[tuple[float, float]] = []  # (when a wake-up was due, when it came)

    async def watch(self) -> None:
        while True:
            due = time.time() + LATE_TICK
            await asyncio.sleep(LATE_TICK)  # a clock, not a wait for a condition: how late it wakes is measured
            woke = time.time()
            if woke - due > LATE_SLACK:
                self.spells.append((due, woke))

    def within(self, start: float, end: float) -> float:
        """Seconds between start and end in which the grader's loop was late."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.spells)

    def net(self, start: float, end: float) -> float:
        """end - start, without the grader's late spells."""
        return end - start - self.within(start, end)


class Lab:
    """Everything one grading run of lab 04 keeps: the plan, the provider and what was seen."""

    def __init__(self, run: Run, plan: Plan, provider: ep.AttachedProvider) -> None:
        self.run = run
        self.plan = plan
        self.provider = provider
        self.stream = run.names.stream(STREAM)
        self.dlq_stream = run.names.stream(DLQ_STREAM)
        self.durable = run.names.durable(DURABLE)
        self.watch: Any = None  # the durable's BrokerWatch, from start()
        self.msgs: dict[int, Msg] = {}  # by stream sequence
        self.exhausted: dict[int, float] = {}
        self.attempts: list[Attempt] = []
        self.publishes: list[Publish] = []
        self.workers: list[Child] = []
        self.redrivers: list[Child] = []
        self.refusal: contextlib.AsyncExitStack | None = None
        self.refused = rules.Planned(
            "make the DLQ stream refuse your first worker's first dead letter (the stream was full)",
            f"publish each email you give up on to {DLQ_SUBJECT} with JetStream and wait for the stream's "
            "confirmation (a core publish is never confirmed)",
        )
        # The transfer: the first dead letter of the email whose mail server stays down is refused too, on
        # whatever delivery the worker gives up on it; for a worker that spends the whole budget that is the
        # last one, and no delivery is left to bring the email back.
        self.last_refused = rules.Planned(
            "make the DLQ stream refuse the first dead letter of the email whose mail server is down (on whatever "
            "delivery your worker gave up on it)",
            f"once an email's retries are spent, publish its dead letter to {DLQ_SUBJECT} with JetStream",
        )
        self.armed: str | None = None  # the order whose first dead letter the DLQ stream refuses next
        self.refusing: rules.Planned | None = None  # the refusal in force
        self.refused_at: tuple[float, float] | None = None  # when the DLQ stream refused, start and end
        self.outage: tuple[float, float] | None = None
        self.fixed_at: float | None = None
        self.redrive_runs: list[tuple[int, float, float, str]] = []  # (run number, start, end, outcome)
        self.idle_since = 0.0  # when the last email was settled (rule 2's evidence)
        self.late: Msg | None = None  # rule 2's late email, kept out of the other checks
        self.first_gone = 0.0  # when worker #1 was gone
        self.phase2_end = 0.0  # when phase 2 had settled (or its deadline passed)
        self.refetch: Any = None  # the pull that proves the worker asked again after an empty fetch
        self.drained = False  # the durable was drained when the idle spell began
        self.problems: list[str] = []
        self.lateness = Lateness()  # the grader's own late spells
        self._subs: list[Any] = []

    # -- what the grader watches on the broker

    async def start(self) -> None:
        from msglab.broker import settle_subscriptions

        nc = self.run.nc
        self.watch = await TOPOLOGY.watch(self.run)
        self._subs = [
            await nc.subscribe(
                f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.{self.durable}", cb=self._on_exhausted
            ),
        ]
        await settle_subscriptions(nc)

    @property
    def deliveries(self) -> dict[int, list[tuple[float, int]]]:
        """Each message's deliveries as (when, delivery #), from the BrokerWatch: only those the server sent."""
        found: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for reply, ts in sorted(self.watch.deliveries.items(), key=lambda item: item[1]):
            tokens = reply.split(".")
            at = 4 if len(tokens) == 9 else 6  # $JS.ACK.<stream>.<durable>.<delivered>.<sseq>... (v1, or v2)
            try:
                n, seq = int(tokens[at]), int(tokens[at + 1])
            except (IndexError, ValueError):
                continue
            if all(k != n for _, k in found[seq]):  # each delivery once
                found[seq].append((ts, n))
        return found

    @property
    def settles(self) -> dict[int, list[Settle]]:
        """Each message's acks, naks, terms and in-progress, from the BrokerWatch: only those answering a
        delivery the server made (a learner can publish on a $JS.ACK subject it built: the server ignores
        that, and so does the grader)."""
        found: dict[int, list[Settle]] = defaultdict(list)
        for ack in self.watch.acks:
            found[ack.stream_seq].append(Settle(ack.ts, ack.kind, ack.delivered, ack.delay))
        return found

    async def _on_exhausted(self, msg: Any) -> None:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            self.exhausted.setdefault(int(json.loads(msg.data)["stream_seq"]), time.time())

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.watch.stop()

    # -- effects the learner's processes call

    def attach(self) -> None:
        self.run.on("send_email", self.on_send)
        # The calls judged by order (Run.workload): a planned kill, or the DLQ's planned refusal, lands only on
        # a call about an email the run published.
        self.run.workload.only(
            "send_email", "dlq_publish", "dlq_refused", "dlq_published", "redrive_published", "republished"
        )
        # A worker's calls count only about an email delivered to it (the redrive reads the DLQ as it likes).
        self.run.workload.held("send_email", "dlq_publish", "dlq_refused", "dlq_published")
        for name in ("dlq_publish", "dlq_refused", "dlq_published", "redrive_published", "republished",
                     "main_refused"):  # fmt: skip
            self.run.on(name, self._publish_handler(name))

    async def on_send(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> Any:
        order, started = key or "", time.time()
        try:
            answer = await er.forward(self.run.nc, self.provider.subject, order, detail)
        except Exception as exc:  # the course's own provider did not answer: never the learner's fault
            self.problems.append(f"the email provider did not answer a send request: {exc!r}")
            raise Refuse("ConnectionResetError", "the course's email provider did not answer") from None
        self.attempts.append(Attempt(started, child.pid, order, answer.status, answer.text, time.time()))
        if answer.error:
            raise Refuse(answer.error, answer.text)
        return answer.text

    def _publish_handler(self, name: str) -> Any:
        async def handler(child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
            await self.on_publish(name, child, key, detail)

        return handler

    async def on_publish(self, name: str, child: Child, key: str | None, detail: dict[str, Any]) -> None:
        # The plan: worker #1's very first dead letter meets a DLQ stream that refuses it. The stream is
        # made full before worker #1 starts, so the refusal costs the worker no time of its ack_wait.
        self.publishes.append(Publish(time.time(), child.pid, name, key, dict(detail)))
        if self.run.workload.decoy(name, key):
            return  # about no email of this run: the DLQ's planned refusal is not spent on it
        if name == "dlq_publish" and self.armed is not None and key == self.armed and self.refusal is None:
            self.armed = None  # answered only after the stream is full: the publish that follows is refused
            await self.begin_refusal(self.last_refused)
        if name == "dlq_refused" and self.refusing is not None:
            self.refusing.fired = True
        if name in ("dlq_refused", "dlq_published"):
            await self.end_refusal()

    # -- the DLQ's refusal

    async def begin_refusal(self, planned: rules.Planned) -> None:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(refuse_publishes(self.run.js, self.dlq_stream))
        self.refusal, self.refusing = stack, planned
        if planned is self.refused:
            self.refused_at = (time.time(), 0.0)
        if planned not in self.run.planned:
            self.run.planned.append(planned)  # rule 1 holds the run to it

    def arm_last_refusal(self, order: str) -> None:
        """The next dead letter of `order` meets a full DLQ stream (rule 1 holds the run to it from now)."""
        self.armed = order
        self.run.planned.append(self.last_refused)

    async def end_refusal(self) -> None:
        if self.refusal is not None:
            stack, self.refusal, self.refusing = self.refusal, None, None
            await stack.aclose()
            if self.refused_at and not self.refused_at[1]:
                self.refused_at = (self.refused_at[0], time.time())

    def note_refusal(self) -> None:
        """Rule 1's words, should a refusal not have happened: what the workers did instead."""
        first = self.workers[0] if self.workers else None
        if not self.refused.fired and first is not None:
            tries = [p for p in self.publishes if p.pid == first.pid and p.name == "dlq_publish"]
            self.refused.seen = f"worker {first.pid} " + (
                f"tried {plural(len(tries), 'dead letter')} and the stream refused none"
                if tries
                else "published no dead letter with JetStream"
            )
        if not self.last_refused.fired and self.last_refused in self.run.planned:
            order = next(e.order for e in self.plan.emails if e.kind == "unreachable")
            tries = [p for p in self.publishes if p.name == "dlq_publish" and p.key == order]
            self.last_refused.seen = (
                f"your workers published no dead letter of {order} with JetStream"
                if not tries
                else f"your workers' dead letters of {order} were never refused"
            )

    # -- publishing and waiting

    async def publish(self, email: Email, judged: bool = True) -> Msg:
        """Publish one email of the plan; `judged`: the lab's checks judge it (all but rule 2's late email)."""
        sent = time.time()  # before the publish: a worker may have it before the PubAck is back
        ack = await self.run.js.publish(self.run.names.subject(SUBJECT), email.payload, headers=email.headers)
        msg = Msg(int(ack.seq), email, sent, email.payload, email.headers)
        if judged:
            self.msgs[msg.seq] = msg
        return msg

    def sent_by(self, order: str) -> list[int]:
        """The processes that got the provider to send this order's email."""
        return [a.pid for a in self.attempts if a.order == order and a.status == 200]

    def originals(self, phase: int | None = None) -> list[Msg]:
        return [m for m in self.msgs.values() if not m.copy_run and (phase is None or m.email.phase == phase)]

    def settled(self, msgs: Iterable[Msg]) -> bool:
        """Each is acked or termed, or the server gave up on it (max_deliver), or no worker is left."""
        if self.workers and not any(w.alive for w in self.workers):
            return True
        return all(m.seq in self.exhausted or any(s.kind in ("ack", "term") for s in self.settles[m.seq]) for m in msgs)

    def pulled_since(self, ts: float) -> bool:
        return any(p.ts >= ts for p in self.watch.pulls)

    async def read_stream(self, stream: str, first: int, last: int) -> list[Any]:
        found = []
        for seq in range(first, last + 1):
            with contextlib.suppress(Exception):  # a message deleted by someone else: not there
                found.append(await self.run.js.get_msg(stream, seq))
        return found

    async def last_seq(self, stream: str) -> int:
        return int((await self.run.js.stream_info(stream)).state.last_seq)

    async def redrive_run(self, number: int, child: Child) -> None:
        """One run of the learner's redrive for the fixed orders; the copies it stored are handled before the next."""
        before = await self.last_seq(self.stream)
        started = time.time()
        reply = await child.call("redrive", CALL_DEADLINE, order_ids=list(self.plan.redrive))
        ended = time.time()
        self.redrive_runs.append((number, started, ended, reply.describe()))
        after = await self.last_seq(self.stream)
        new = []
        for raw in await self.read_stream(self.stream, before + 1, after):
            headers = dict(raw.headers or {})
            order = _order_of(raw.data, headers)
            email = next((e for e in self.plan.emails if e.order == order), None)
            if email is None:
                email = Email(order or "?", "unknown", "", "", phase=3)
            msg = Msg(int(raw.seq), email, ended, bytes(raw.data or b""), headers, copy_run=number)
            self.msgs[msg.seq] = msg
            new.append(msg)
        await self.run.wait_for(lambda: self.settled(new), COPY_SETTLE)


def _configure(behaviour: ep.Behaviour, plan: Plan) -> None:
    """What is wrong with which email at the provider (the outage comes later, at its moment)."""
    for op, args in er.breaks(plan.emails):
        behaviour.control(op, **args)


def _fix(behaviour: ep.Behaviour, plan: Plan) -> None:
    """The operators fix two causes: the template is deployed, the recipient's mail server is back."""
    for op, args in er.fixes([plan.get(order) for order in plan.redrive]):
        behaviour.control(op, **args)


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    plan = draw_plan(run.seed)
    # A planned fault lands only on calls about the run's emails. All of them from the start: worker #1 runs
    # before the first email is published, and calls made while no key is registered would count.
    run.workload.add(*(email.order for email in (*plan.emails, plan.late)))
    folder = tempfile.mkdtemp(prefix="msglab-grade04-")
    run.tasks.append(asyncio.ensure_future(_remove_at_exit(folder)))
    await _provision(run.js, run.names)
    provider = await ep.attach(run.nc, os.path.join(folder, "provider.sqlite"), prefix=run.names.subject("provider"))
    _configure(provider.behaviour, plan)
    lab = Lab(run, plan, provider)
    run.tasks.append(asyncio.ensure_future(lab.lateness.watch()))
    await lab.start()
    lab.attach()
    workers = HeldSpawns(run, "email_worker", lambda n: [WORKER_CRASH] if n == 0 else [], limit=2)
    try:
        await _play(lab, workers)
    finally:
        await lab.end_refusal()
        await workers.cancel()
    await workers.settle()  # so rule 3 sees a process that ended on its own
    if lab.problems:
        from msglab.errors import GraderError

        raise GraderError(lab.problems[0])
    lab.note_refusal()
    evidence = await Evidence.collect(lab)
    await lab.stop()
    return [
        _none_lost_check(evidence),
        _not_both_check(evidence),
        _permanent_check(evidence),
        _bounded_check(evidence),
        _transient_check(evidence),
        _backoff_check(evidence),
        _dlq_once_check(evidence),
        _dlq_record_check(evidence),
        _line_check(evidence),
        _redrive_check(evidence),
        _idle_check(evidence),
        run.workload_check("email"),
    ]


async def _remove_at_exit(folder: str) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _play(lab: Lab, workers: HeldSpawns) -> None:
    """The workload, phase by phase (see the module's docstring)."""
    run, plan, phase = lab.run, lab.plan, Phases(lab.run)

    # The redrive processes start in the background: they are needed only at the end.
    async def spawn_redrivers() -> list[Child]:
        return list(await asyncio.gather(run.spawn("redrive", faults=[REDRIVE_CRASH]), run.spawn("redrive")))

    redrivers = asyncio.ensure_future(spawn_redrivers())
    run.tasks.append(redrivers)
    workers.prepare(2)
    async with phase("worker #1 alone"):  # the DLQ refuses its first dead letter; it dies after its first confirmed one
        await lab.begin_refusal(lab.refused)
        first = await workers.release()
        assert first is not None
        lab.workers.append(first)
        for email in plan.phase(1):
            await lab.publish(email)
        await run.wait_for(lambda: not first.alive or lab.settled(lab.originals(1)), STEP_WAIT)
        await workers.stop(first)  # one that never got to its planned crash is killed: rule 1 says why
        lab.first_gone = time.time()
        await lab.end_refusal()
    async with phase("worker #2, then the outage"):  # it finishes what worker #1 left (redelivered after ack_wait)
        released = time.time()
        second = await workers.release()
        assert second is not None
        lab.workers.append(second)
        await run.wait_for(lambda: lab.pulled_since(released) or not second.alive, FIRST_PULL)
        await run.wait_for(lambda: lab.settled(lab.originals(1)), PHASE1_SETTLE)
        start = time.time()
        lab.provider.behaviour.down_until = start + OUTAGE
        lab.outage = (start, start + OUTAGE)
        lab.arm_last_refusal(next(e.order for e in plan.phase(2) if e.kind == "unreachable"))
        for email in plan.phase(2):  # the poison email as the provider goes down, four ordinary ones during it
            wait = start + email.offset - time.time()
            if wait > 0:
                await asyncio.sleep(wait)  # the workload's schedule: emails arrive during the outage
            await lab.publish(email)
        await run.wait_for(lambda: lab.settled(lab.originals()), SETTLE)
        lab.phase2_end = time.time()
    async with phase("idle"):  # rule 2: the running worker survives an empty fetch...
        marks = [s.ts for ss in lab.settles.values() for s in ss] + list(lab.exhausted.values())
        lab.idle_since = since = max(marks) if marks else time.time()
        lab.drained = await TOPOLOGY.drained(run)
        await run.wait_for(lambda: lab.watch.refetched_after_idle(since) is not None or gone(second), IDLE_DEADLINE)
        lab.refetch = lab.watch.refetched_after_idle(since)
    async with phase("late email"):  # ... and sends an email that comes later
        late = lab.late = await lab.publish(plan.late, judged=False)
        await run.wait_for(lambda: gone(second) or (bool(lab.sent_by(plan.late.order)) and lab.settled([late])),
                           LATE_DEADLINE)  # fmt: skip
    async with phase("redrive"):  # two causes fixed; the redrive runs three times, killed in its first run
        _fix(lab.provider.behaviour, plan)
        lab.fixed_at = time.time()
        lab.redrivers = list(await redrivers)
        for number, child in ((1, lab.redrivers[0]), (2, lab.redrivers[1]), (3, lab.redrivers[1])):
            await lab.redrive_run(number, child)


# --- evidence ----------------------------------------------------------------------------------


@dataclass
class DlqEntry:
    """One message in the DLQ stream, and the email message it is about (if it names one)."""

    seq: int
    data: bytes
    headers: dict[str, str]
    msg: Msg | None
    via: Publish | None  # the learner's publish that stored it, as its process reported it


@dataclass
class Life:
    """What happened to one message of the EMAILS stream, from the grader's records."""

    msg: Msg
    deliveries: list[tuple[float, int]]
    settles: list[Settle]
    attempts: list[Attempt]
    publishes: list[Publish]  # DLQ publishes about it
    dlq: list[DlqEntry]
    exhausted: float | None
    fetched: list[tuple[float, int, int]] = field(default_factory=list)  # (when, pid, delivery) the worker noted
    explained: list[str] = field(default_factory=list)  # per gap between deliveries: why it came again ("" retry)

    @property
    def sent(self) -> list[Attempt]:
        return [a for a in self.attempts if a.status == 200]

    def sent_before(self, ts: float | None) -> list[Attempt]:
        return [a for a in self.sent if ts is None or a.ts < ts]

    @property
    def failures(self) -> list[Attempt]:
        return [a for a in self.attempts if a.status != 200]

    def gaps(self) -> list[tuple[float, str]]:
        """Seconds between consecutive deliveries, and why each redelivery came ('' for a retry)."""
        times = [t for t, _ in self.deliveries]
        return [(times[i + 1] - times[i], self.explained[i]) for i in range(len(times) - 1)]

    def waits(self) -> list[tuple[float, float, float | None]]:
        """For each retry (a redelivery the worker let come): (the wait, measured, the nak's delay if it asked one).

        The wait is the delay the worker asked the broker for in its nak, when it nak'ed the failed delivery
        (the server holds the message exactly that long); otherwise the server's own timer (ack_wait) ran
        from the delivery, and the wait is the time between the two deliveries.
        """
        found = []
        for ((t0, n0), (t1, _)), (_, why) in zip(itertools.pairwise(self.deliveries), self.gaps(), strict=True):
            if why:
                continue
            naks = [s for s in self.settles if s.kind == "nak" and s.n == n0]
            asked = (naks[-1].delay or 0.0) if naks else None
            found.append((asked if asked is not None else t1 - t0, t1 - t0, asked))
        return found

    def permanent_retries(self) -> list[float]:
        """Gaps of redeliveries the worker let come after a permanent failure (a 4xx, or a payload it cannot read)."""
        groups = self.attempts_per_delivery()
        found = []
        for i, (gap, why) in enumerate(self.gaps()):
            last = groups[i][-1] if groups[i] else None
            if not why and (last is None or not transient_status(last.status)):
                found.append(gap)
        return found

    def first_handled(self) -> float | None:
        marks = [a.ts for a in self.attempts] + [s.ts for s in self.settles] + [p.ts for p in self.publishes]
        return min(marks) if marks else None

    def delivery_at(self, pid: int, ts: float) -> int | None:
        """The delivery (its number) process `pid` was handling at `ts`: the one it last fetched, else by time.

        The grader's copy of a delivery can reach it after the worker's first call about it, so the worker's
        own note, on the same channel as its calls, orders them; only deliveries the server sent count.
        """
        seen = {n for _, n in self.deliveries}
        noted = [(t, n) for t, p, n in self.fetched if p == pid and t <= ts and n in seen]
        if noted:
            return max(noted)[1]
        if any(p == pid for _, p, _ in self.fetched):
            return None  # this process never fetched it before ts
        earlier = [n for t, n in self.deliveries if t <= ts + 0.05]
        return earlier[-1] if earlier else None

    def by_delivery(self, events: Iterable[Any]) -> dict[int, list[Any]]:
        """Events with .pid and .ts (sends, publishes) grouped by the delivery they belong to."""
        groups: dict[int, list[Any]] = {n: [] for _, n in self.deliveries}
        for event in events:
            n = self.delivery_at(event.pid, event.ts)
            if n is None and self.deliveries:
                n = self.deliveries[0][1]
            if n is not None:
                groups.setdefault(n, []).append(event)
        return groups

    def attempts_per_delivery(self) -> list[list[Attempt]]:
        """The sends of each delivery, in delivery order."""
        groups = self.by_delivery(self.attempts)
        return [groups[n] for _, n in self.deliveries]


@dataclass
class Evidence:
    lab: Lab
    lives: dict[int, Life]  # by stream sequence
    dlq: list[DlqEntry]
    worker_ends: list[tuple[float, int, str, str | None]]  # (when, pid, how, the email it was at)
    traces: dict[int, list[str]]
    late: Life | None = None  # rule 2's late email

    @property
    def plan(self) -> Plan:
        return self.lab.plan

    def originals(self) -> list[Life]:
        return sorted((lf for lf in self.lives.values() if not lf.msg.copy_run), key=lambda lf: lf.msg.seq)

    def copies(self) -> list[Life]:
        return sorted((lf for lf in self.lives.values() if lf.msg.copy_run), key=lambda lf: lf.msg.seq)

    def life(self, order: str) -> Life:
        return next(lf for lf in self.originals() if lf.msg.email.order == order)

    def at(self, ts: float) -> str:
        return self.lab.run.at(ts)

    def trace(self, life: Life, *more: str) -> list[str]:
        return [*self.traces.get(life.msg.seq, []), *more]

    def deaths(self) -> str:
        """A sentence when the long-running worker ended on its own, for messages about what did not happen."""
        second = self.lab.workers[1] if len(self.lab.workers) > 1 else None
        if second is None or not (second.unplanned or second.protocol_error):
            return ""
        return (
            f"\nYour long-running worker {second.pid} {second.how_it_ended()}: nobody was left to take the emails "
            "(see no_unplanned_deaths)."
        )

    @classmethod
    async def collect(cls, lab: Lab) -> Evidence:
        run = lab.run
        last = await lab.last_seq(lab.dlq_stream)
        raws = await lab.read_stream(lab.dlq_stream, 1, last)
        by_seq: dict[Any, Publish] = {}
        for p in lab.publishes:  # the publish that stored each entry (a duplicate stored nothing)
            if p.name == "dlq_published" and not p.detail.get("duplicate"):
                by_seq.setdefault(p.detail.get("seq"), p)
        entries: list[DlqEntry] = []
        for raw in raws:
            headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
            via = by_seq.get(int(raw.seq))
            entries.append(DlqEntry(int(raw.seq), bytes(raw.data or b""), headers, _match(lab, raw, headers, via), via))
        ends: list[tuple[float, int, str, str | None]] = [
            (e.ts, e.pid, "nemesis", e.key) for e in run.log.events("crash") if e.role == "email_worker"
        ]
        first = lab.workers[0] if lab.workers else None
        if first is not None and first.killed == "grader":
            ends.append((lab.first_gone, first.pid, "grader", None))
        elif first is not None and first.unplanned:
            ends.append((lab.first_gone, first.pid, "itself", None))
        msgs = sorted(lab.msgs.values(), key=lambda m: m.seq)

        def life_of(msg: Msg, msgs: list[Msg]) -> Life:
            mine = _belongs(lab, msg, msgs)
            life = Life(
                msg,
                sorted(lab.deliveries.get(msg.seq, [])),
                list(lab.settles.get(msg.seq, [])),
                [a for a in lab.attempts if mine(a.order, a.ts, a.pid)],
                [p for p in lab.publishes if p.name.startswith("dlq") and _publish_is(p, msg, mine)],
                [e for e in entries if e.msg is msg],
                lab.exhausted.get(msg.seq),
                [
                    (e.ts, e.pid, int(e.detail.get("n", 0)))
                    for e in run.log.events("note", "fetched")
                    if e.detail.get("seq") == msg.seq
                ],
            )
            life.explained = _explain(life, ends)
            return life

        lives = {msg.seq: life_of(msg, msgs) for msg in msgs}
        ev = cls(lab, lives, entries, ends, {}, life_of(lab.late, [lab.late]) if lab.late else None)
        ev.traces = {seq: _trace(ev, life) for seq, life in lives.items()}
        return ev


def _belongs(lab: Lab, msg: Msg, msgs: list[Msg]) -> Any:
    """A test: does an event about `order`, by process `pid` at `ts`, belong to this message (not another copy)?

    The message of that order the process fetched last before the event (its own notes order them); without
    notes, the one the server delivered last before it.
    """
    same = [m for m in msgs if m.email.order == msg.email.order]
    notes: dict[int, list[tuple[float, int]]] = defaultdict(list)  # seq -> (when, pid) fetched
    for event in lab.run.log.events("note", "fetched"):
        notes[int(event.detail.get("seq", 0) or 0)].append((event.ts, event.pid))
    firsts = {m.seq: min((t for t, _ in lab.deliveries.get(m.seq, [])), default=m.published) for m in same}

    def mine(order: str | None, ts: float, pid: int = 0) -> bool:
        if order != msg.email.order:
            return False
        fetched = {m.seq: max((t for t, p in notes[m.seq] if p == pid and t <= ts), default=None) for m in same}
        known = [m for m in same if fetched[m.seq] is not None]
        if known:
            return max(known, key=lambda m: fetched[m.seq] or 0.0) is msg
        before = [m for m in same if firsts[m.seq] <= ts + 0.05]
        owner = max(before, key=lambda m: firsts[m.seq]) if before else same[0]
        return owner is msg

    return mine


def _publish_is(publish: Publish, msg: Msg, mine: Any) -> bool:
    named = publish.detail.get("stream_seq")
    if named is not None and str(named).strip().isdigit():
        return int(str(named)) == msg.seq
    return bool(mine(publish.key, publish.ts, publish.pid))


def _match(lab: Lab, raw: Any, headers: dict[str, str], via: Publish | None) -> Msg | None:
    """The email message a DLQ entry is about: the one its Dlq-Stream-Seq names, else one with its payload."""
    named = _header(headers, STREAM_SEQ)
    if named and named.strip().isdigit() and int(named) in lab.msgs:
        return lab.msgs[int(named)]
    order = _order_of(raw.data, headers)
    candidates = [m for m in lab.msgs.values() if m.email.order == order or m.payload == bytes(raw.data or b"")]
    if not candidates:
        return None
    stored = via.ts if via is not None else time.time()
    before = [
        m for m in candidates if min((t for t, _ in lab.deliveries.get(m.seq, [])), default=m.published) <= stored
    ]
    return max(before or candidates, key=lambda m: m.seq)


def _explain(life: Life, ends: list[tuple[float, int, str, str | None]]) -> list[str]:
    """Why each redelivery came: '' when the worker let it come back (a retry), else the cause it could not help."""
    why: list[str] = []
    answered = {s.n for s in life.settles if s.kind in ("ack", "nak", "term")}
    attempts = life.by_delivery(life.attempts)
    publishes = life.by_delivery(life.publishes)
    killed_at = {life.delivery_at(pid, ts) for ts, pid, _, _ in ends}
    for (_, n0), _next in itertools.pairwise(life.deliveries):
        refused = any(p.name == "dlq_refused" for p in publishes.get(n0, []))
        handled = n0 in answered or bool(attempts.get(n0)) or bool(publishes.get(n0))
        if refused:
            why.append("the DLQ stream refused its dead letter")
        elif n0 in killed_at and n0 not in answered:
            why.append("the worker holding it was killed")
        elif not handled and life.msg.email.kind != "malformed":
            why.append("no worker handled that delivery: its ack_wait ran out")
        else:
            why.append("")
    return why


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _trace(ev: Evidence, life: Life) -> list[str]:
    lab, msg = ev.lab, life.msg
    steps: list[tuple[float, str]] = []
    if msg.copy_run:
        steps.append((msg.published, f"redrive run {msg.copy_run} republished it: stream seq {msg.seq}"))
    else:
        steps.append((msg.published, f"published: stream seq {msg.seq} ({msg.email.words()})"))
    for t, n in life.deliveries:
        steps.append((t, f"delivery #{n}"))
    for a in life.attempts:
        said = f"sent ({a.text})" if a.status == 200 else _short(a.text if a.status else f"connection reset: {a.text}")
        steps.append((a.ts, f"worker {a.pid} asked the provider to send it: {said}"))
    for s in life.settles:
        if s.kind == "nak":
            steps.append((s.ts, f"nak'ed (delivery {s.n}), " + (f"delay {s.delay:.2f} s" if s.delay else "no delay")))
        elif s.kind in ("ack", "term"):
            steps.append((s.ts, f"{'acked' if s.kind == 'ack' else 'termed'} (delivery {s.n})"))
    for p in life.publishes:
        if p.name == "dlq_refused":
            error = str(p.detail.get("error"))
            error = error.split("description='")[-1].rstrip("'") if "description='" in error else _short(error, 60)
            steps.append((p.ts, f"worker {p.pid}'s dead letter was refused by the DLQ stream ({error})"))
        elif p.name == "dlq_published":
            what = "a duplicate, dropped by the DLQ stream" if p.detail.get("duplicate") else "stored"
            steps.append((p.ts, f"worker {p.pid} published it to the DLQ: {what} (DLQ seq {p.detail.get('seq')})"))
    for t, pid, how, key in ev.worker_ends:
        held = life.delivery_at(pid, t) if any(p == pid for _, p, _ in life.fetched) else None
        answered = {s.n for s in life.settles if s.ts <= t}
        if held is not None and held not in answered:  # it held this email when it ended
            said = {
                "nemesis": f"SIGKILLed (injected) right after the DLQ stream confirmed its dead letter of {key}",
                "grader": "stopped by the grader (its planned crash never came)",
                "itself": "ended on its own",
            }[how]
            if how == "nemesis" and key == msg.email.order:
                said = "SIGKILLed (injected) right after the DLQ stream confirmed this dead letter, before settling it"
            steps.append((t, f"worker {pid} {said}"))
    if life.exhausted is not None:
        steps.append((life.exhausted, f"the server stopped delivering it after {MAX_DELIVER} deliveries (max_deliver)"))
    if lab.outage and msg.email.phase == 2 and not msg.copy_run:
        steps += [
            (lab.outage[0], "the provider goes down (503 to every request)"),
            (lab.outage[1], "the provider is back"),
        ]
    if lab.fixed_at and msg.email.order in lab.plan.redrive and life.deliveries and not msg.copy_run:
        cause = "the template is deployed" if msg.email.kind == "template" else "the mail server is back"
        steps.append((lab.fixed_at, f"its cause is fixed ({cause})"))
    for entry in life.dlq:
        if entry.via is None:
            steps.append((lab.fixed_at or time.time(), f"in the DLQ as DLQ seq {entry.seq}"))
    trace = Trace(lab.run, keep=16)
    for ts, text in steps:
        trace.add(ts, text)
    return trace.lines()


def _gaps_text(life: Life) -> str:
    return ", ".join(f"{g:.2f}" for g, _ in life.gaps()) + " s"


# --- the checks ----------------------------------------------------------------------------------


def _pick(lives: list[Life], order: tuple[str, ...]) -> Life:
    """The life to quote first: by kind, in the order given, then by stream sequence."""

    def rank(life: Life) -> tuple[int, int]:
        kind = life.msg.email.kind
        return (order.index(kind) if kind in order else len(order), life.msg.seq)

    return min(lives, key=rank)


def _said(life: Life) -> str:
    return f"{life.msg.email.order} ({life.msg.email.words()}, stream seq {life.msg.seq})"


def _last_failure(life: Life, before: float | None = None) -> str:
    fails = [a for a in life.failures if before is None or a.ts <= before]
    if fails:
        return _short(fails[-1].text if fails[-1].status else "a reset connection", 100)
    if life.msg.email.kind == "malformed":
        return "its payload is not JSON"
    return "no answer from the provider"


def _none_lost_check(ev: Evidence) -> Check:
    title = "every email is sent by the provider or kept in the DLQ (none lost)"
    originals = ev.originals()
    lost = [lf for lf in originals if not lf.sent_before(ev.lab.fixed_at) and not lf.dlq]
    if not lost:
        return Check("none_lost", title, True)
    refused_then_settled = [
        lf for lf in lost if any(p.name == "dlq_refused" for p in lf.publishes) and any(
            s.kind in ("ack", "term") for s in lf.settles)
    ]  # fmt: skip
    exhausted = [lf for lf in lost if lf.exhausted is not None]
    life = (refused_then_settled or exhausted or [_pick(lost, ("bounce", "unreachable", "malformed", "template"))])[0]
    message = (
        f"{plural(len(lost), 'email')} of {len(originals)} {'was' if len(lost) == 1 else 'were'} lost: {_said(life)} "
        "was never sent and is not in the DLQ."
    )
    settled = [s for s in life.settles if s.kind in ("ack", "term")]
    if life in refused_then_settled:
        refused = next(p for p in life.publishes if p.name == "dlq_refused")
        message += (
            f"\nThe DLQ stream refused its dead letter at {ev.at(refused.ts)} (the grader had made it full), and your "
            f"worker {'termed' if settled[0].kind == 'term' else 'acked'} the email anyway at {ev.at(settled[0].ts)}: "
            "the email left the queue without reaching the DLQ."
        )
        hint = (
            "settle a dead email only after the DLQ stream has confirmed your publish; when the publish fails, leave "
            "the email unsettled (or nak it) so it comes back and is dead-lettered then"
        )
    elif life.exhausted is not None and any(p.name == "dlq_refused" for p in life.publishes):
        refused = next(p for p in life.publishes if p.name == "dlq_refused")
        n = life.delivery_at(refused.pid, refused.ts) or 0
        tried = [p for p in life.publishes if p.name == "dlq_publish"]
        if n >= MAX_DELIVER:
            message += (
                f"\nYour worker first dead-lettered it at delivery #{n}, the last the budget allows, and the DLQ "
                "stream refused that publish (the grader had made it full). Left unsettled, a message on its last "
                "delivery does not come back: the server stopped delivering it, and the email is in neither place."
            )
        else:
            message += (
                f"\nYour worker first dead-lettered it at delivery #{n}, and the DLQ stream refused that publish (the "
                f"grader had made it full); {plural(len(tried) - 1, 'more dead letter')} followed before the server "
                f"stopped delivering it after delivery #{MAX_DELIVER}."
            )
        message += f" It was tried at the provider {len(life.attempts)} times; its last answer: {_last_failure(life)}."
        hint = (
            "a dead letter refused on the last delivery has no delivery left to come back on: keep the email until "
            "the DLQ stream has it (try the publish again while you keep your claim on the message), or give up one "
            "delivery earlier, so a refused dead letter still has a delivery to try again"
        )
    elif life.exhausted is not None:
        times = [t for t, _ in life.deliveries]
        span = times[-1] - times[0] if times else 0.0
        message += (
            f"\nIt was delivered {MAX_DELIVER} times (the durable's max_deliver) within {span:.2f} s, and then the "
            "server stopped delivering it. max_deliver moves a message nowhere: it stays in the stream, delivered to "
            f"no one, and nobody is told. Its last answer was: {_last_failure(life)}."
        )
        hint = (
            f"on the last delivery your budget allows (delivery {MAX_DELIVER}), dead-letter the email yourself "
            "instead of asking for one more retry"
        )
    elif settled:
        message += (
            f"\nYour worker {'termed' if settled[0].kind == 'term' else 'acked'} it at {ev.at(settled[0].ts)} "
            f"(delivery {settled[0].n}) without sending it and without a dead letter. Its answer was: "
            f"{_last_failure(life)}."
        )
        hint = "an email you give up on goes to the DLQ first; settle it only once the DLQ has it"
    elif not life.deliveries:
        message += "\nNo worker ever took it." + ev.deaths()
        hint = "keep the worker running: it must take every email on the durable"
    else:
        t, n = life.deliveries[-1]
        message += (
            f"\nAt the end of the run it was still unsettled: its last delivery was #{n} at {ev.at(t)}, and no retry "
            "or dead letter followed." + ev.deaths()
        )
        hint = "settle every delivery one way or another: sent (ack), retry later (nak with a delay), or DLQ (term)"
    return Check("none_lost", title, False, message, trace=ev.trace(life), hint=hint)


def _not_both_check(ev: Evidence) -> Check:
    title = "no email is both sent and kept in the DLQ"
    both = [lf for lf in ev.originals() if lf.sent_before(ev.lab.fixed_at) and lf.dlq]
    if not both:
        return Check("not_both", title, True)
    life = _pick(both, ("flaky", "outage", "ok"))
    entry, sent = life.dlq[0], life.sent_before(ev.lab.fixed_at)[0]
    dead_at = entry.via.ts if entry.via else None
    message = (
        f"{plural(len(both), 'email')} {'was' if len(both) == 1 else 'were'} both sent and dead-lettered: "
        f"{_said(life)} "
        f"was sent at {ev.at(sent.ts)} and is also in the DLQ (DLQ seq {entry.seq}). Whoever works through the DLQ "
        "would chase an email the customer already has."
    )
    if dead_at is not None and dead_at < sent.ts:
        after = [s for s in life.settles if s.ts >= dead_at]
        answer = f"{after[0].kind}ed it" if after and after[0].kind != "ack" else "did not settle it"
        answer = {"naked it": "nak'ed it", "termed it": "termed it"}.get(answer, answer)
        message += (
            f"\nIt was dead-lettered at {ev.at(dead_at)} ({_last_failure(life, dead_at)}); then your worker "
            f"{answer}, so the email came back and went through."
        )
        hint = (
            "once an email's dead letter is confirmed, settle it for good so it is never tried again; and dead-letter "
            "only what cannot succeed within the budget"
        )
    else:
        message += "\nIt was dead-lettered after the provider had sent it."
        hint = "dead-letter an email only when its send failed for good, never after a send went through"
    return Check("not_both", title, False, message, trace=ev.trace(life), hint=hint)


def _permanent_check(ev: Evidence) -> Check:
    title = "a permanent failure (a 4xx answer, a payload your code cannot read) is never retried"
    retried = [
        lf for lf in ev.originals()
        if lf.msg.email.kind in PERMANENT and (lf.permanent_retries() or any(
            len(g) > 1 for g in lf.attempts_per_delivery()))
    ]  # fmt: skip
    if not retried:
        return Check("permanent_not_retried", title, True)
    life = _pick(retried, ("bounce", "malformed", "template"))
    email = life.msg.email
    if life.permanent_retries():
        message = (
            f"{_said(life)} was retried: delivered {len(life.deliveries)} times, {_gaps_text(life)} apart, and it "
            "failed the same way every time."
        )
    else:
        most = max(len(g) for g in life.attempts_per_delivery())
        message = f"{_said(life)} was sent to the provider {most} times within one delivery, and failed every time."
    if email.kind == "malformed":
        message += (
            "\nIts payload is cut off, so your code failed on the same bytes at every try: no retry can change them."
        )
    else:
        message += (
            f"\nThe provider answered: {_last_failure(life)}. A 4xx status says the request itself is wrong; sent "
            "again it gets the same answer."
        )
    hint = (
        "judge the failure from its error: a 4xx status (other than 429) or a payload your code cannot parse fails "
        "the same way on every try, so dead-letter it at the first failure instead of asking for a retry"
    )
    return Check("permanent_not_retried", title, False, message, trace=ev.trace(life), hint=hint)


def _bounded_check(ev: Evidence) -> Check:
    title = (
        f"no failed email is retried sooner than {MIN_RETRY:g} s after it failed, and none is tried more than its "
        f"budget of {MAX_DELIVER} times"
    )
    hot: list[tuple[Life, float]] = []
    short: list[tuple[Life, float]] = []
    looped: list[tuple[Life, int, float]] = []
    over: list[Life] = []
    for life in [*ev.originals(), *ev.copies()]:
        waits = [w for w, _, _ in life.waits()]
        if waits and min(waits) < HOT_GAP:
            hot.append((life, min(waits)))
        elif waits and min(waits) < MIN_RETRY - 0.001:  # a nak's delay is exact; a measured gap only grows
            short.append((life, min(waits)))
        for group in life.attempts_per_delivery():
            close = [b.ts - a.ts for a, b in itertools.pairwise(group) if a.status != 200]
            if close and min(close) < HOT_GAP:
                looped.append((life, len(group), min(close)))
        if len(life.attempts) > MAX_DELIVER:
            over.append(life)
    if not hot and not looped and not short and not over:
        return Check("retries_bounded", title, True)
    if hot:
        life, gap = min(hot, key=lambda h: (h[0].msg.email.kind not in PERMANENT, h[0].msg.seq))
        asked = [a for _, _, a in life.waits() if a is not None]
        message = (
            f"{plural(len(hot), 'email')} came back at once after failing: {_said(life)} was delivered "
            f"{len(life.deliveries)} times, {_gaps_text(life)} apart. The provider got the same failing request again "
            "before anything could have changed."
        )
        if asked and min(asked) < HOT_GAP:
            message += (
                " Its failed deliveries were nak'ed with "
                + ("no delay" if not max(asked) else f"delays of {asked}")
                + ": the server hands such a message straight back."
            )
        hint = (
            f"give every retry a delay (at least {MIN_RETRY:g} s, growing with each delivery), so the broker holds "
            "the email meanwhile instead of handing it straight back"
        )
    elif looped:
        life, count, gap = looped[0]
        message = (
            f"{_said(life)} was sent to the provider {count} times within one delivery, {gap * 1000:.0f} ms apart: "
            "your worker retried it in a loop, at once."
        )
        hint = "retry by letting the email come back later (a delayed redelivery), never in a loop inside one delivery"
    elif short:
        life, wait = min(short, key=lambda h: h[1])
        asked = [a for _, _, a in life.waits() if a is not None]
        shown = ", ".join(f"{w:.2f}" for w, _, _ in life.waits())
        message = (
            f"{_said(life)} was retried after waits of {shown} s"
            + (" (the delays its naks asked for)" if asked else "")
            + f": the shortest, {wait:.2f} s, is under the {MIN_RETRY:g} s the README asks for before a first retry. "
            "A retry that comes that soon meets the same failure: an outage or a rate limit lasts longer."
        )
        hint = (
            f"wait at least {MIN_RETRY:g} s before the first retry, and longer before each next one (e.g. 0.1, 0.2, "
            "0.4, 0.8 s): the delay your nak asks for is the wait"
        )
    else:
        life = over[0]
        message = (
            f"{_said(life)} was sent to the provider {len(life.attempts)} times; its budget is {MAX_DELIVER} tries "
            f"({MAX_DELIVER} deliveries, one try each)."
        )
        hint = "one try per delivery, and at most 5 deliveries: count the deliveries the broker reports, not loops"
    return Check("retries_bounded", title, False, message, trace=ev.trace(life), hint=hint)


def _transient_check(ev: Evidence) -> Check:
    title = (
        "every email that can go through within its budget (ordinary, or failing only with 5xx, 429 or a reset "
        "connection) ends sent, not dead-lettered"
    )
    unsent = [lf for lf in ev.originals() if lf.msg.email.must_send and not lf.sent_before(ev.lab.fixed_at)]
    if not unsent:
        lucky = [lf for lf in ev.originals() if lf.msg.email.must_send and _outlasted_by_pace(ev, lf)]
        if not lucky:
            return Check("transient_delivered", title, True)
        life = lucky[0]
        times = [t for t, _ in life.deliveries]
        window = ev.lab.outage or (0.0, 0.0)
        message = (
            f"{_said(life)} went through only because this machine was slow: its {len(times)} deliveries came"
            f" {_gaps_text(life)} apart, each retry asked for at once (a nak without a delay), and they happened to"
            f" reach past the provider's outage ({ev.at(window[0])} to {ev.at(window[1])}, {OUTAGE:g} s). On a faster"
            f" machine all {MAX_DELIVER} fit inside it and the email is lost, as nothing in your code prevents."
        )
        hint = (
            f"spread the retries over more than the provider's outages ({OUTAGE:g} s here): wait longer before "
            "each retry, starting at 0.1 s or more"
        )
        return Check("transient_delivered", title, False, message, trace=ev.trace(life), hint=hint)
    life = _pick(unsent, ("outage", "flaky", "ok"))
    times = [t for t, _ in life.deliveries]
    message = (
        f"{plural(len(unsent), 'email')} that could go through {'was' if len(unsent) == 1 else 'were'} never sent: "
    )
    message += f"{_said(life)}."
    outage = ev.lab.outage
    outage_text = (
        f" The provider was down from {ev.at(outage[0])} to {ev.at(outage[1])} ({OUTAGE:g} s)." if outage else ""
    )
    if life.dlq:
        entry = life.dlq[0]
        dead_at = entry.via.ts if entry.via else (times[-1] if times else 0.0)
        n = (life.delivery_at(entry.via.pid, entry.via.ts) if entry.via else None) or (
            life.deliveries[-1][1] if life.deliveries else 0
        )
        if n <= 1 or n < MAX_DELIVER:
            fails = [a for a in life.failures if a.ts <= dead_at] or life.failures
            status = fails[-1].status if fails else 503
            meaning = {
                429: "That answer says your worker was sending too fast, not that the email is wrong",
                0: "A dropped connection says nothing against the email",
                502: "That answer says a mail server on the way is in trouble, not the email",
            }.get(status, "That answer says the provider is in trouble, not the email")
            message += (
                f"\nYour worker dead-lettered it at delivery #{n} ({ev.at(dead_at)}) after this answer: "
                f"{_last_failure(life, dead_at)}. {meaning}: the same request goes through later." + outage_text
            )
            hint = (
                "a 5xx status, a 429 or a reset connection is transient: retry it with a growing delay, and give up "
                f"only when its {MAX_DELIVER} deliveries are used"
            )
        else:
            span = times[-1] - times[0] if times else 0.0
            inside = sum(outage is not None and outage[0] <= t <= outage[1] for t in times)
            message += (
                f"\nIts {len(times)} deliveries spanned only {span:.2f} s ({_gaps_text(life)} apart), {inside} of "
                f"them while the provider was down; the last answer was: {_last_failure(life, dead_at)}. The budget "
                "ran out before the email could go through." + outage_text
            )
            hint = (
                f"spread the budget over more than the provider's outages ({OUTAGE:g} s here): with waits that "
                "grow (say 0.1, 0.2, 0.4, 0.8 s) five deliveries span 1.5 s"
            )
    elif life.exhausted is not None:
        span = times[-1] - times[0] if times else 0.0
        message += (
            f"\nIts {len(times)} deliveries came within {span:.2f} s ({_gaps_text(life)} apart) and all failed; then "
            "the server stopped delivering it (max_deliver)." + outage_text
        )
        hint = (
            f"spread the retries over more than the provider's outages ({OUTAGE:g} s here): wait longer before "
            "each retry, starting at 0.1 s or more"
        )
    elif not life.deliveries:
        message += "\nNo worker ever took it." + ev.deaths()
        hint = "keep the worker running: it must take every email on the durable"
    else:
        message += f"\nAt the end of the run it was still waiting for a retry (last delivery at {ev.at(times[-1])})."
        message += ev.deaths()
        hint = f"keep the whole retry series short enough to finish: five deliveries within {SETTLE - 1:g} s"
    return Check("transient_delivered", title, False, message, trace=ev.trace(life), hint=hint)


def _outlasted_by_pace(ev: Evidence, life: Life) -> bool:
    """Sent only after two or more failures in the provider's outage, each retry asked for at once (a nak without
    a delay, answered within SAT_OUT of the failure, at the median): the outage was outlasted by the machine's
    pace, not by the worker's waits, so on a faster machine the same file loses it (a verdict that must not flip).
    """
    outage = ev.lab.outage
    if outage is None or not life.sent:
        return False
    sent_at = life.sent[0].ts
    failed = [a for a in life.failures if a.ts < sent_at and a.done]
    if len(failed) < 2 or not any(outage[0] <= a.ts <= outage[1] for a in failed):
        return False
    holds = []
    for (_, n), group in zip(life.deliveries, life.attempts_per_delivery(), strict=True):
        fails = [a for a in group if a.status != 200 and a.done and a.ts < sent_at]
        naks = [st for st in life.settles if st.n == n and st.kind == "nak"]
        if not fails:
            continue
        if not naks or (naks[0].delay or 0.0) > 0:
            return False  # a wait asked of the broker (or a redelivery after ack_wait): not at once
        holds.append(naks[0].ts - fails[-1].done)
    return len(holds) >= 2 and statistics.median(holds) <= SAT_OUT


def _backoff_check(ev: Evidence) -> Check:
    title = (
        "the waits between deliveries of a retried email grow (from its deliveries and the delays it was nak'ed with)"
    )
    flat = []
    for candidate in ev.originals():
        w = [wait for wait, _, _ in candidate.waits()]
        if len(w) >= 3 and not (w[-1] >= GROWTH * w[0] and w[-1] - w[0] >= 0.05):
            flat.append(candidate)
    if not flat:
        return Check("backoff_grows", title, True)
    life = _pick(flat, ("unreachable", "outage", "flaky"))
    waits = life.waits()
    shown = ", ".join(f"{w:.2f}" for w, _, _ in waits)
    message = (
        f"{_said(life)} was retried after waits of {shown} s: they do not grow (the last should be at least "
        f"{GROWTH:g} times the first). At a fixed pace a long outage eats the whole budget, and every waiting email "
        "hits the provider again the moment it comes back."
    )
    if all(a is not None for _, _, a in waits):
        message += " Those are the delays your worker asked for in its naks."
    elif all(abs(m - ACK_WAIT) < 0.15 for _, m, _ in waits):
        message += (
            f" Your worker did not answer failed deliveries: each came back when ack_wait ({ACK_WAIT} s) ran out."
        )
    hint = (
        "make each wait longer than the one before, from the delivery count (e.g. 0.1, 0.2, 0.4, 0.8 s here; "
        "1 s, 10 s, 100 s, 1000 s is a common production list)"
    )
    return Check("backoff_grows", title, False, message, trace=ev.trace(life), hint=hint)


def _dlq_once_check(ev: Evidence) -> Check:
    title = "no email is in the DLQ twice, even when the worker is killed between the DLQ publish and settling"
    twice = [lf for lf in ev.lives.values() if len(lf.dlq) > 1]
    if not twice:
        return Check("dlq_once", title, True)
    life = min(twice, key=lambda lf: lf.msg.seq)
    seqs = [e.seq for e in life.dlq]
    message = f"{_said(life)} is in the DLQ {len(seqs)} times (DLQ seq {', '.join(map(str, seqs))})."
    first, second = life.dlq[0], life.dlq[1]
    ids = [e.via.detail.get("msg_id") if e.via else _header(e.headers, "Nats-Msg-Id") for e in (first, second)]
    killed = [e for e in ev.worker_ends if e[2] == "nemesis" and first.via is not None and e[0] >= first.via.ts - 0.001]
    if killed:
        message += (
            f"\nYour worker {killed[0][1]} was SIGKILLed right after the DLQ stream confirmed its dead letter "
            "(the grader's planned crash), before the email was settled; the broker delivered it again, and the "
            "next delivery was dead-lettered again."
        )
    else:
        message += "\nIt was dead-lettered on more than one delivery."
    if not any(ids):
        message += " Neither publish carried a Nats-Msg-Id, so the DLQ stream could not tell the second from a new one."
        hint = (
            "give the dead letter a Nats-Msg-Id made from the email message itself (its stream sequence): the DLQ "
            "stream then drops a second copy published after a crash"
        )
    elif ids[0] != ids[1]:
        message += (
            f" The two publishes carried different Nats-Msg-Ids ({ids[0]!r}, {ids[1]!r}): the id must be the same on "
            "every delivery of one email message."
        )
        hint = "make the Nats-Msg-Id from the message's stream sequence, never from the delivery count or the clock"
    else:
        message += f" Both carried Nats-Msg-Id {ids[0]!r}, but they were stored more than the duplicate window apart."
        hint = "keep the DLQ stream's duplicate window longer than a redelivery takes"
    return Check("dlq_once", title, False, message, trace=ev.trace(life), hint=hint)


def _record_problems(ev: Evidence, entry: DlqEntry) -> list[tuple[str, str]]:
    """What is wrong with one DLQ entry: (what, hint key)."""
    msg = entry.msg
    if msg is None:
        return [("it names no email of this run: no Dlq-Stream-Seq header, and its payload matches none", "seq")]
    found: list[tuple[str, str]] = []
    if entry.data != msg.payload:
        found.append((f"its payload is not the original bytes (it holds {entry.data[:60]!r})", "payload"))
    for name in HEADERS:
        if _header(entry.headers, name) != msg.headers.get(name):
            got = _header(entry.headers, name)
            found.append((f"the original {name} header is {'missing' if got is None else repr(got)}", "headers"))
    life = ev.lives.get(msg.seq)
    reason = _header(entry.headers, REASON)
    if not reason or not reason.strip():
        found.append((f"it has no {REASON} header (what went wrong)", "reason"))
    elif life is not None and life.failures:
        last = [a for a in life.failures if entry.via is None or a.ts <= entry.via.ts] or life.failures
        status = last[-1].status
        wanted = str(status) if status else "reset"
        types = ("EmailApiError",) if status else ("ConnectionResetError", "ConnectionError")
        if wanted not in reason.lower() and last[-1].text[:24].lower() not in reason.lower():
            found.append((f"its {REASON} ({_short(reason, 60)!r}) does not say what the provider answered "
                          f"({_short(last[-1].text, 60)!r})", "reason"))  # fmt: skip
        elif not any(t.lower() in reason.lower() for t in types):
            found.append((f"its {REASON} ({_short(reason, 60)!r}) does not name the error's type ({types[0]}), "
                          "only its text", "reason"))  # fmt: skip
    elif msg.email.kind == "malformed" and not re.search(r"[A-Za-z]\w*(Error|Exception)\b", reason):
        found.append((f"its {REASON} ({_short(reason, 60)!r}) does not name the error's type (what your code "
                      "raised on the cut-off payload)", "reason"))  # fmt: skip
    count = _header(entry.headers, DELIVERIES)
    expected = None
    if life is not None and entry.via is not None:
        expected = life.delivery_at(entry.via.pid, entry.via.ts)
    if count is None or not count.strip().isdigit():
        found.append((f"its {DELIVERIES} header is {'missing' if count is None else repr(count)}", "count"))
    elif expected is not None and int(count) != expected:
        found.append((f"its {DELIVERIES} says {count}, but it was dead-lettered at delivery #{expected}", "count"))
    seq = _header(entry.headers, STREAM_SEQ)
    if seq is None or seq.strip() != str(msg.seq):
        found.append((f"its {STREAM_SEQ} is {'missing' if seq is None else repr(seq)}, not {msg.seq}", "seq"))
    return found


def _dlq_record_check(ev: Evidence) -> Check:
    title = "each DLQ entry carries the original payload and headers, the reason, the delivery count, the stream seq"
    bad = [(entry, problems) for entry in ev.dlq if (problems := _record_problems(ev, entry))]
    if not bad:
        return Check("dlq_record", title, True)
    entry, problems = bad[0]
    about = f"{entry.msg.email.order} (stream seq {entry.msg.seq})" if entry.msg else "an unknown email"
    message = (
        f"{len(bad)} DLQ {'entry' if len(bad) == 1 else 'entries'} {'is' if len(bad) == 1 else 'are'} incomplete. "
        f"DLQ seq {entry.seq}, about {about}: " + "; ".join(p for p, _ in problems) + "."
    )
    message += f"\nIts headers: {_short(json.dumps(entry.headers), 240)}"
    hints = {
        "payload": "publish the message's own bytes (msg.data) to the DLQ, unchanged: the redrive sends them again",
        "headers": "copy every original header (msg.headers) into the dead letter, then add the Dlq-* headers",
        "reason": f"put what went wrong in {REASON}: the error's type and text, as the provider answered",
        "count": f"put the delivery that gave up in {DELIVERIES}: the number the broker reports on the message",
        "seq": f"put the message's stream sequence in {STREAM_SEQ}: it names the email message the entry is about",
    }
    trace = ev.trace(ev.lives[entry.msg.seq]) if entry.msg else []
    return Check("dlq_record", title, False, message, trace=trace, hint=hints[problems[0][1]])


def _line_check(ev: Evidence) -> Check:
    title = (
        "other emails keep moving while one waits for its retries (none waits behind another email's retries inside"
        f" one delivery, nor over {QUEUE_AGE_MAX} s for a worker that sits out another email's wait)"
    )
    followers = [lf for lf in ev.originals() if lf.msg.email.kind == "outage"]
    end = ev.lab.phase2_end or time.time()
    late = ev.lab.lateness  # every time below is the grader's stamps' difference, without its own late spells
    # Retries made inside one delivery: the worker held that email (sleeping, looping) instead of taking the next.
    held = [(lf, group) for lf in ev.lives.values() for group in lf.attempts_per_delivery() if len(group) > 1]
    # Waits sat out inside one delivery: the failed try's answer was back, and the nak came only much later.
    # (A delivery whose dead letter the worker published, refused, in between spent that time on the DLQ.)
    sat: list[tuple[Life, Attempt, Settle]] = []
    holds: dict[int, list[float]] = {}  # per worker: every failed delivery's wait from the answer to the nak
    for lf in ev.lives.values():
        dead = lf.by_delivery(lf.publishes)
        for (_, n), group in zip(lf.deliveries, lf.attempts_per_delivery(), strict=True):
            fails = [a for a in group if a.status != 200 and a.done]
            naks = [s for s in lf.settles if s.n == n and s.kind == "nak"]
            if fails and naks and not dead.get(n):
                hold = late.net(fails[-1].done, naks[0].ts)
                holds.setdefault(fails[-1].pid, []).append(hold)
                if hold > SAT_OUT:
                    sat.append((lf, fails[-1], naks[0]))
    sat = [(lf, a, st) for lf, a, st in sat if statistics.median(holds[a.pid]) > SAT_OUT]
    stuck = []
    for life in followers:
        handled = life.first_handled()
        until = handled if handled is not None else end
        age = late.net(life.msg.published, until)
        # A worker that retried another email inside one delivery while this one waited held the line, however
        # fast its machine ran the loop: judged by what happened, not by how long it took.
        holding = [
            (lf, g) for lf, g in held if lf is not life and any(life.msg.published <= a.ts <= until for a in g[1:])
        ]
        if age <= QUEUE_AGE_MAX and not holding:
            continue
        sitting = [(lf, a, s) for lf, a, s in sat if lf is not life and a.done < until and s.ts > life.msg.published]
        if holding or sitting or age > QUEUE_AGE_HARD:
            stuck.append((life, age, handled, holding, sitting))
    if not stuck:
        return Check("line_keeps_moving", title, True)
    life, age, handled, holding, sitting = max(stuck, key=lambda x: x[1])
    slow = late.within(life.msg.published, handled if handled is not None else end)
    message = (
        f"{_said(life)} waited {age:.2f} s before any worker took it"
        + ("" if handled is not None else " (it was never taken)")
        + (f" (and {slow:.2f} s more while the grader itself ran late, not counted)" if slow >= 0.01 else "")
        + (f"; the bound is {QUEUE_AGE_MAX} s." if age > QUEUE_AGE_MAX else ", behind another email's retries.")
    )
    if holding:
        other, group = holding[0]
        message += (
            f"\nMeanwhile your worker {group[0].pid} held {other.msg.email.order} and tried it {len(group)} times "
            "within one delivery, at " + ", ".join(ev.at(a.ts) for a in group[:5]) + ": it waited out that "
            "email's retries itself instead of taking the next one."
        )
    elif sitting:
        other, failed, nak = max(sitting, key=lambda x: late.net(x[1].done, x[2].ts))
        held_for = late.net(failed.done, nak.ts)
        message += (
            f"\nMeanwhile your worker {failed.pid} held {other.msg.email.order} for {held_for:.2f} s "
            f"after its failed try (the provider's answer at {ev.at(failed.done)}, its nak at {ev.at(nak.ts)}): it "
            "sat out that wait itself, and every email behind it waited too."
        )
    message += ev.deaths()
    hint = (
        "while an email waits for its retry, let the broker hold it (a delayed redelivery) and take the next email: "
        "a handler that sleeps out a retry, or loops on it, holds up every email behind it"
    )
    return Check("line_keeps_moving", title, False, message, trace=ev.trace(life), hint=hint)


def _redrive_check(ev: Evidence) -> Check:
    title = "redrive, run twice (and once killed halfway), sends each redriven email exactly once"
    lab = ev.lab
    fixed = lab.fixed_at or time.time()
    sends = {
        o: [a for a in lab.attempts if a.order == o and a.status == 200 and a.ts >= fixed] for o in lab.plan.redrive
    }
    copies = ev.copies()
    extra = sorted({lf.msg.email.order for lf in copies if lf.msg.email.order not in lab.plan.redrive})
    wrong = [o for o, s in sends.items() if len(s) != 1]
    if not wrong and not extra:
        return Check("redrive_once", title, True)
    runs = "; ".join(
        f"run {number}: " + (", ".join(f"{lf.msg.email.order} (seq {lf.msg.seq})" for lf in copies
                                       if lf.msg.copy_run == number) or "stored nothing")
        for number, *_ in lab.redrive_runs
    )  # fmt: skip
    killed = {number for number, *_ in lab.redrive_runs if number == 1 and lab.redrivers and lab.redrivers[0].fired}
    outcomes = "; ".join(
        f"run {number} " + ("was SIGKILLed as planned, after its first republish" if number in killed else outcome)
        for number, _, _, outcome in lab.redrive_runs
    )
    order = wrong[0] if wrong else extra[0]
    life = ev.life(order)
    if wrong and len(sends[order]) > 1:
        message = (
            f"{order} was sent {len(sends[order])} times after the redrive. What each run stored in EMAILS: {runs}. "
            "Run 1 was SIGKILLed right after its first republish was stored; runs 2 and 3 ran to the end. Every "
            "copy stored is one more email to the customer."
        )
        hint = (
            "give each republish a Nats-Msg-Id that names the DLQ entry (e.g. its DLQ sequence): the EMAILS stream "
            "then drops the same republish from a second run, or from a run after a crash"
        )
    elif wrong:
        mine = [lf for lf in copies if lf.msg.email.order == order]
        dropped = [p for p in lab.publishes if p.name == "redrive_published" and p.key == order and p.detail.get(
            "duplicate")]  # fmt: skip
        message = f"{order} was never sent after the redrive (its cause was fixed at {ev.at(fixed)})."
        if not mine and dropped:
            message += (
                f" Your redrive published it, but the EMAILS stream dropped it as a duplicate (Nats-Msg-Id "
                f"{dropped[0].detail.get('msg_id')!r}): that id had been used before."
            )
            hint = "make the redrive's Nats-Msg-Id new to the EMAILS stream: name the DLQ entry, not the order"
        elif not mine and not life.dlq:
            message += f" It never reached the DLQ (see none_lost), so no redrive could find it; runs: {outcomes}."
            hint = "first make sure every email you give up on ends in the DLQ (none_lost says where this one was lost)"
        elif not mine:
            message += f" No run stored a copy of it in EMAILS ({outcomes})."
            hint = (
                "read the DLQ, and republish the entries of the orders you are given to orders.email with their "
                "original payload and headers"
            )
        else:
            copy = mine[0]
            answers = ", ".join(_short(a.text, 60) for a in copy.attempts) or "none"
            message += f" Copies stored: {runs}; the provider's answers to them: {answers}." + ev.deaths()
            hint = "republish the original payload and headers unchanged, so the worker handles the copy like the email"
            life = copy
    else:
        message = (
            f"your redrive republished {', '.join(extra)}, which it was not asked to redrive ({runs}). Its cause "
            "was not fixed: it failed again."
        )
        hint = "redrive only the orders you are given: the others' causes are not fixed"
    return Check("redrive_once", title, False, message, trace=ev.trace(life), hint=hint)


IDLE_WORDS = rules.IdleWords(
    title="the running worker survives an empty queue and sends an email that arrives later",
    done="sent",
    hint_no_refetch="after an empty fetch, fetch again: the loop must keep asking for emails",
    hint_slow="keep fetching from the durable and send each email as it comes",
    failures=("EmailApiError", "ConnectionResetError", "JSONDecodeError"),
)


def _idle_check(ev: Evidence) -> Check:
    """Rule 2, on the platform's check: the late email, sent by the worker that was running all along."""
    lab, late = ev.lab, ev.late
    second = lab.workers[1] if len(lab.workers) > 1 else None
    if late is None:  # the run never got that far (a grader error is raised before this)
        return rules.survives_idle(lab.run.at, _idle_proof(lab, time.time()), second, [], [], IDLE_WORDS)
    proof = _idle_proof(lab, late.msg.published)
    return rules.survives_idle(
        lab.run.at, proof, second, lab.sent_by(late.msg.email.order), _trace(ev, late), IDLE_WORDS
    )


def _idle_proof(lab: Lab, late_at: float) -> rules.IdleProof:
    return rules.IdleProof(
        lab.plan.late.order, late_at, lab.idle_since, lab.drained, lab.refetch, IDLE_DEADLINE, LATE_DEADLINE
    )
