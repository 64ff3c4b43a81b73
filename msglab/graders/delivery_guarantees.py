"""Lab 02 grader: an invoice worker that must never lose an invoice, crashed where it hurts most,
facing an invoicing service that fails in two ways.

Workload (seeded). Invoice requests arrive on the durable `invoicer`. The learner's worker runs in
one process after another ("incarnations"). Before each of the first three is released, three
fresh requests are published for it, and it is SIGKILLed at one point, in an order and on a call
drawn from the seed (calls 1-3, so every crash falls on a request it could invoice):

  before_work    on its n-th call of env.send_invoice, before the service sees it;
  after_work     right after its n-th invoice went out (before any line of the worker runs again);
  after_settled  right after its n-th env.settled call was recorded.

Then the last incarnation is released together with five more requests: two normal ones, two the
invoicing service cannot take for a while (ServiceUnavailable on every attempt for 1.05-1.15 s
after the first, and on at least the first three, so retries spread over more than a second: rule
5), and one it can never take (AccountClosed, every time). The worker must judge from the error
which is worth retrying. The grader restarts a worker that dies on its own (and fails it for that,
rule 3) until the durable holds nothing. Once it is drained, the grader waits until the broker saw
the running worker ask again after an empty fetch (BrokerWatch.refetched_after_idle) and publishes
one late request: that same process must invoice it (rule 2). Then one big request: the service
takes SLOW (1.0-1.2 s, 2.5-3 ack_wait) over its invoice, while the grader, as a second worker of the
group, pulls from the durable: a worker that sends no sign of life (in_progress) while its call runs
loses the claim, and the broker hands the grader the request (keeps_claim).

What is judged, and from what (never from the learner's notes):
  the invoicing service's own record (effects answered by the grader), the grader's copy of
  every ack, nak, term and pull request (BrokerWatch), consumer_info, and the crashes it fired.
  - no_lost_invoices: every request the service could take was invoiced;
  - duplicates_only_after_crash (rule 6): an invoice goes out again only where a worker process
    that had sent it ended before the broker had its ack, however the worker batches;
  - settled_after_ack: every invoice is reported, and env.settled(o) arrives only once the broker
    has o's ack. When settled arrives, the learner's process is blocked in that call, so no ack
    can leave it any more; the grader catches its BrokerWatch up (BrokerWatch.caught_up: every ack
    the server had before the call is then in it) and looks. An ack written without waiting for
    the server may still be unread by it, so the first report without a visible ack waits up to
    ACK_PATIENCE (0.1 s, a quarter of ack_wait, so the wait itself never causes a redelivery)
    before it counts as proof; later ones need not wait. Each effect is recorded after the same
    catch-up, so "acked before its invoice" compares the server's order, not two sockets'. The
    crash right after a report is the second, race-free proof: the request came back after it
    (rule 8). A report cut off by a kill between the ack and the report is allowed (rule 6).
  - refused_requests_reported: the request refused for good is reported with env.reject, not
    tried again unless a crash explains it, and settled (acked or termed) so it stops coming back;
  - retries_spaced: no hot loop; a try refused with ServiceUnavailable is followed by the next no sooner
    than MIN_RETRY_GAP (the lesson's immediate nak() comes back within a millisecond);
  - keeps_claim: the big invoice is not handed to another worker while yours waits for it;
  - all_acked, late_request_handled, guarantees_named, faults_fired (rule 1, in the lab's own
    words), and the platform's no_unplanned_deaths (rule 3).

Incarnations are started ahead of their turn and released with a line on stdin, so a restart
costs milliseconds, not a Python start-up.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from msglab.grading import rules
from msglab.grading.labkit import LabEnv
from msglab.grading.nemesis import Crash, rng
from msglab.grading.observe import BrokerWatch
from msglab.grading.rules import an, how_ended, plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, Trace, gone, held
from msglab.grading.verdict import Check
from msglab.world.invoicing import AccountClosed, Invoicing, InvoicingError, ServiceUnavailable
from msglab.world.invoicing import closed_text as _closed_text
from msglab.world.invoicing import unavailable_text as _unavailable_text

if TYPE_CHECKING:  # the learner's processes import this module too: they need none of the grader's side
    from msglab.grading.effects import Event
    from msglab.grading.harness import Child, Run

STREAM = "BILLING"
SUBJECT = "billing.invoice"
DURABLE = "invoicer"
ACK_WAIT = 0.4  # seconds; production uses 30 s or more. A busy machine must never stall a correct
# worker past it (a batch of ten is invoiced, acked and reported well within it even under load).
TOPOLOGY = Topology(STREAM, "billing.>", DURABLE, SUBJECT, ACK_WAIT)
LEARNER_SUBJECTS = [SUBJECT]  # the worker only pulls and acks: nothing of the course's to publish or hear
FRESH = 3  # normal requests published for each crash incarnation just before it starts
FINAL_NORMAL = 2  # normal requests published with the last incarnation
TRANSIENT = 2  # of those published with the last incarnation: unavailable for a while
REFUSED = 1  # ...: refused for good (the customer's account is closed)
OUTAGE = (1.05, 1.15)  # seconds a transient request stays unavailable after its first attempt: over a
# second (rule 5); with redelivery every ack_wait its 3rd try (~0.8 s) still fails, its 4th (~1.2 s) succeeds
SLOW = (1.0, 1.2)  # seconds the invoicing service takes over the big invoice (after the late request): 2.5 to 3
# ack_wait, so a worker that sends the broker no sign of life loses its claim at least twice over
COLLEAGUE_PULL = 0.1  # seconds each pull of the grader's colleague worker waits (a second worker of the group)
MIN_RETRY_GAP = 0.1  # seconds: the least a request the service cannot take now waits before its next try; the
# lesson's immediate nak() came back in under a millisecond, hundreds of tries a second at a restarting service
UNAVAILABLE_TRIES = 3  # ... and it fails at least its first three tries: on a loaded machine, where the 3rd
# try may come after the outage, a budget of three tries (max_deliver=3) must still lose it
KINDS = {  # crash kind -> (counted point, moment), as nemesis plans name them
    "before_work": ("send_invoice", "before"),  # the n-th call of env.send_invoice
    "after_work": ("invoice_sent", "after"),  # the n-th invoice that went out (a refused call is no invoice)
    "after_settled": ("settled", "after"),  # the n-th call of env.settled
}
WHERE = {
    "before_work": "before the invoice went out",
    "after_work": "right after the invoice went out",
    "after_settled": "right after env.settled",
}
COUNTED = {  # crash kind -> (the call it falls on, what the call counts): rule 1's words for a crash that did not fire
    "before_work": ("its env.send_invoice call", "env.send_invoice call"),
    "after_work": ("the invoice it sent", "invoice"),
    "after_settled": ("its env.settled call", "env.settled call"),
}
CRASH_DEADLINE = 3.0  # a crash incarnation that has not crashed by then is stopped
MAIN_DEADLINE = 6.0  # how long the last incarnation has to finish everything
ACK_PATIENCE = 0.1  # how long a report waits for an ack copy the grader has not seen yet (see on_settled)
REPORT_GRACE = 1.0  # once all is acked, how long an env.settled may still take to arrive
IDLE_DEADLINE = 6.0  # longest wait for the worker to ask again after an empty fetch (nats-py's default is 5 s)
LATE_DEADLINE = 3.0  # how long the running worker has for the late request
MAX_WORKERS = 12  # processes in all (3 crashed, 1 killed before env.reject, restarts); not restarted forever
TRACE_LINES = 14  # steps quoted per request in a verdict
SERVICE_ERRORS = ("InvoicingError", "ServiceUnavailable", "AccountClosed")

AT_MOST_ONCE, AT_LEAST_ONCE, EFFECTIVELY_ONCE = "at-most-once", "at-least-once", "effectively-once"
NEITHER = "neither"
# The workers of labs/02_delivery_guarantees/workers.py and the guarantee each gives the invoice.
ANSWERS = {
    "core_subscriber": AT_MOST_ONCE,  # core NATS keeps nothing for a subscriber that is down
    "ack_then_work": AT_MOST_ONCE,  # the ack is on the server before the work: a crash in between loses it
    "work_then_ack": AT_LEAST_ONCE,  # a crash after the work, before the ack, brings it back: done twice
    "ack_in_finally": NEITHER,  # a failed call is acked anyway (lost); a kill after the charge redoes it
    "dedup_then_ack": EFFECTIVELY_ONCE,  # redelivered, but the processed row makes the second time a no-op
}


# --- what runs inside the learner's processes ------------------------------------------------


def _add_errors(env: Any) -> None:
    env.InvoicingError = InvoicingError
    env.ServiceUnavailable = ServiceUnavailable
    env.AccountClosed = AccountClosed


def _add_effects(env: Any) -> None:
    """Give env the lab's effects; each is a call the grader answers (or SIGKILLs the process in)."""

    async def send_invoice(order_id: str) -> None:
        key = str(order_id)
        # A real call to a service is a network round trip, and like any round trip it gives the
        # event loop a turn: what the worker left in its write buffer (an ack) reaches the server.
        await env.nc.flush()
        takes = env.world.call("send_invoice", key)  # raises ServiceUnavailable or AccountClosed when refused
        if takes:  # a big invoice: the service works on it this long, and the worker's event loop runs meanwhile
            await asyncio.sleep(float(takes))
        # Counted apart from calls, so the crash after an invoice never lands on a refused call.
        env.world.call("invoice_sent", key)

    def settled(order_id: str) -> None:
        env.world.call("settled", str(order_id))

    def reject(order_id: str, reason: str = "") -> None:
        env.world.call("reject", str(order_id), reason=str(reason)[:300])

    _add_errors(env)
    env.send_invoice = send_invoice
    env.settled = settled
    env.reject = reject


async def role_invoice_worker(env: LabEnv, learner: Any) -> None:
    """One incarnation of the invoice worker: hands in GUARANTEES, waits for its turn, runs until killed."""
    _add_effects(env)
    guarantees = getattr(learner, "GUARANTEES", None)
    if isinstance(guarantees, dict):
        guarantees = {str(k): None if v is None else str(v) for k, v in guarantees.items()}
    env.world.call("guarantees", None, value=guarantees)  # type: ignore[attr-defined]
    held(env)
    await learner.invoice_worker(env)


async def playground(env: Any) -> None:
    """For the lab notebook: the same stream and durable, and an invoicing service that prints.

    Order ids ending in 3 meet a service that is restarting (for 0.6 s after their first try);
    ids ending in 4 belong to a customer whose account is closed; ids ending in 5 take 1 s to invoice.
    """
    await TOPOLOGY.provision(env.js, env.names)
    _add_errors(env)
    service = Invoicing()

    async def send_invoice(order_id: str) -> None:
        key = str(order_id)
        kind = "refused" if key.endswith("4") else "transient" if key.endswith("3") else "normal"
        service.attempt(key, kind, customer="c-" + key.split("-")[-1].rjust(4, "0"), outage=0.6)
        if key.endswith("5"):
            await asyncio.sleep(1.0)  # a big invoice: longer than ack_wait
        print(f"invoice sent for {key}")

    env.send_invoice = send_invoice
    env.settled = lambda order_id: print(f"dashboard: {order_id} settled")
    env.reject = lambda order_id, reason="": print(f"billing team: {order_id} cannot be invoiced ({reason})")


# --- the grader ------------------------------------------------------------------------------


@dataclass
class AckWatch(BrokerWatch):
    """BrokerWatch, plus which acks asked the server for a confirmation (ack_sync sends a reply subject)."""

    confirmed: set[int] = field(default_factory=set)  # indexes into acks

    async def _on_ack(self, msg: Any) -> None:
        before = len(self.acks)
        await super()._on_ack(msg)
        if len(self.acks) > before and msg.reply:
            self.confirmed.add(len(self.acks) - 1)

    def settled_on_broker(self, seq: int, before: float | None = None) -> Any:
        """The first ack or term of that message (before a time, if given): the broker will not deliver it again."""
        for ack in self.acks:
            if ack.stream_seq == seq and ack.kind in ("ack", "term") and (before is None or ack.ts <= before):
                return ack
        return None

    def was_confirmed(self, ack: Any) -> bool:
        return any(self.acks[i] is ack for i in self.confirmed)


@dataclass
class Plan:
    """The seeded faults of one run: one crash per crash incarnation, and which requests fail how."""

    crashes: list[tuple[str, int]]  # (kind, call number within that incarnation)
    final: list[str]  # what each request published with the last incarnation is: normal, transient, refused
    outages: list[float]  # seconds each transient request stays unavailable, in order
    slow: float  # seconds the invoicing service takes over the big invoice

    @classmethod
    def draw(cls, seed: int) -> Plan:
        kinds = list(KINDS)
        rng(seed, "crash_order").shuffle(kinds)
        calls = rng(seed, "crash_calls")
        crashes = [(kind, calls.randint(1, 3)) for kind in kinds]
        final = ["normal"] * FINAL_NORMAL + ["transient"] * TRANSIENT + ["refused"] * REFUSED
        rng(seed, "final_order").shuffle(final)
        outage = rng(seed, "outage")
        slow = round(rng(seed, "slow").uniform(*SLOW), 2)
        return cls(crashes, final, [round(outage.uniform(*OUTAGE), 2) for _ in range(TRANSIENT)], slow)

    def faults(self, incarnation: int) -> list[Crash]:
        if incarnation >= len(self.crashes):
            return []
        kind, call = self.crashes[incarnation]
        effect, when = KINDS[kind]
        hint = (
            "report every invoice that went out to the dashboard with env.settled, one call per request"
            if kind == "after_settled"
            else "every request your worker takes must go to env.send_invoice, one call per request, while the"
            " process keeps running"
        )
        what, counted = COUNTED[kind]
        return [Crash(effect, call, when, point=f"{WHERE[kind]} on {what} #{call}", counted=counted, hint=hint)]


@dataclass
class Request:
    key: str
    seq: int
    kind: str  # normal, transient, refused, late
    customer: str
    published: float
    outage: float = 0.0
    takes: float = 0.0  # seconds the service takes to issue its invoice (the big one only)


class Billing:
    """One run's world: the requests, the invoicing service and dashboard the grader answers for."""

    def __init__(self, run: Run, watch: AckWatch, plan: Plan) -> None:
        self.run = run
        self.watch = watch
        self.plan = plan
        self.requests: dict[str, Request] = {}
        self.publishing: dict[str, asyncio.Event] = {}  # set once the request is stored (see known)
        self.service = Invoicing(min_tries=UNAVAILABLE_TRIES)  # the invoicing service the grader answers for
        self.guarantees: list[Any] = []
        self.spawns = HeldSpawns(run, "invoice_worker", plan.faults, MAX_WORKERS)
        self.ended = self.spawns.ended  # pid -> when the process was seen to end (crash time for a crash)
        self.workers: list[Child] = self.spawns.released  # released, in order
        self.outages = list(plan.outages)
        self.early_confirmed = False  # a report proven to have come before its ack
        self.drained_at = 0.0  # when the durable was first seen with nothing left (and the reports in)
        self.clean_since = 0.0
        # Rule 1's plan for the refused request: a kill right before the first env.reject, which falls between the
        # report and the settle for a worker that settles first (the request is then never reported), and before
        # both for one that reports first (it comes back and is reported then). Fired by on_reject.
        self.reject_kill = rules.Planned(
            "kill your invoice worker right before its first env.reject call (between reporting the closed account"
            " and settling it on the broker, whichever your worker does first)",
            "report a request that can never be invoiced with env.reject(order_id, reason) at its first refusal",
        )
        run.planned.append(self.reject_kill)
        self.taken: list[tuple[float, int]] = []  # (when, delivery #) the grader's colleague got the big request
        run.on("send_invoice", self.on_send_invoice)
        run.on("invoice_sent", self.on_quiet)
        run.on("settled", self.on_settled)
        run.on("reject", self.on_reject)
        run.on("guarantees", self.on_guarantees)
        run.workload.only("send_invoice", "invoice_sent", "settled")  # the calls crash points count, by order id
        run.workload.held("send_invoice", "invoice_sent", "settled")  # and only about a request that worker got

    # --- requests ------------------------------------------------------------------------------

    async def publish(self, kinds: list[str]) -> None:
        for kind in kinds:
            number = len(self.requests) + 1
            key, customer = f"o-{number}", f"c-{1000 + 37 * number}"
            outage = self.outages.pop(0) if kind == "transient" else 0.0
            body = {"order_id": key, "customer": customer, "amount": 40 + 5 * number}
            self.publishing[key] = stored = asyncio.Event()
            self.run.workload.add(key)  # a planned kill lands only on calls about requests the run published
            seq = await TOPOLOGY.publish(self.run, json.dumps(body).encode())
            takes = self.plan.slow if kind == "slow" else 0.0
            request = Request(key, seq, kind, customer, time.time(), outage, takes)
            self.requests[key] = request
            stored.set()

    async def known(self, key: str | None) -> Request | None:
        """The request, once stored: a running worker can take it and call before the publish's ack reached us."""
        stored = self.publishing.get(key or "")
        if stored is not None:
            await stored.wait()
        return self.requests.get(key or "")

    def keys(self, *kinds: str) -> list[str]:
        return [k for k, r in self.requests.items() if r.kind in kinds]

    # --- the invoicing service, the dashboard, the billing team ---------------------------------

    async def on_send_invoice(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> float:
        from msglab.grading.harness import Refuse

        request = await self.known(key)
        # Every ack the server had before this call is in the watch first, stamped before it: whether a request
        # was acked before its invoice then never depends on which of two sockets the grader read first.
        await self.watch.caught_up()
        try:
            if request is not None:
                self.service.attempt(request.key, request.kind, request.customer, request.outage, time.time())
        except (AccountClosed, ServiceUnavailable) as refused:
            outcome = "refused" if isinstance(refused, AccountClosed) else "unavailable"
            self.run.record_effect(child, "send_invoice", key, outcome=outcome, call=call)
            raise Refuse(type(refused).__name__, str(refused)) from None
        self.run.record_effect(child, "send_invoice", key, outcome="sent", call=call)
        return request.takes if request is not None else 0.0  # the learner's side waits this long

    async def on_quiet(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        request = await self.known(key)
        await self.watch.caught_up()  # the kill right after an invoice is stamped after every ack the server had
        if request is not None and request.takes:  # when the big invoice was done (rule 1 and the claim check)
            self.run.record_effect(child, "invoice_done", key, call=call)

    async def on_settled(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        request = await self.known(key)
        acked, confirmed = None, False
        if request is not None:
            # Every ack the server had before this call is in the watch now (BrokerWatch.caught_up).
            await self.watch.caught_up()
            acked = self.watch.settled_on_broker(request.seq)
            if acked is None and not self.early_confirmed:
                # The learner's process is blocked in this call, so no ack can leave it now; one it wrote
                # without waiting for the server may still be unread by the server. Wait for it, well within
                # ack_wait so the wait itself never causes a redelivery; once a report is proven early, later
                # ones need not wait.
                deadline = time.monotonic() + ACK_PATIENCE
                while acked is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
                    await self.watch.caught_up()
                    acked = self.watch.settled_on_broker(request.seq)
                confirmed = self.early_confirmed = acked is None
        self.run.record_effect(child, "settled", key, call=call, acked=acked is not None, confirmed=confirmed)

    async def on_reject(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        request = await self.known(key)
        if not self.reject_kill.fired and request is not None and request.kind == "refused":
            self.reject_kill.fired = True
            # A settle the server had before this call is in the watch before the kill is logged.
            await self.watch.caught_up()
            self.run.log.record("crash", "reject", key, pid=child.pid, role=child.role, call=call, when="before")
            await child.kill("nemesis")
            return
        self.run.record_effect(child, "reject", key, call=call, reason=str(detail.get("reason", ""))[:200])

    async def on_guarantees(self, child: Child, key: str | None, detail: dict[str, Any], call: int) -> None:
        self.guarantees.append(detail.get("value"))

    # --- what the record says --------------------------------------------------------------------

    def calls(self, name: str, key: str | None = None, outcome: str | None = None) -> list[Event]:
        return [
            e
            for e in self.run.log.events("effect", name)
            if (key is None or e.key == key) and (outcome is None or e.detail.get("outcome") == outcome)
        ]

    def invoices(self, key: str) -> list[Event]:
        return self.calls("send_invoice", key, "sent")

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for event in self.calls("send_invoice", outcome="sent"):
            counts[event.key or ""] += 1
        return counts

    def crashes(self) -> list[Event]:
        return self.run.log.events("crash")

    def held_and_lost(self, key: str, evidence: list[Event]) -> int:
        """Worker processes that took this request (their calls show it) and ended before the broker had its ack."""
        seq = self.requests[key].seq

        def settled(end: float) -> bool:
            return self.watch.settled_on_broker(seq, before=end) is not None

        return len(rules.held_and_lost(self.ended, evidence, settled))

    def allowance(self, key: str) -> rules.Allowance:
        """Rule 6 (msglab.grading.rules.Allowance) for one request's invoices."""
        return rules.allowance(self.ended, self.invoices(key), self.watch, [self.requests[key].seq])

    def allowed_invoices(self, key: str) -> int:
        return self.allowance(key).allowed

    def unexplained(self) -> dict[str, int]:
        return {k: n for k, n in self.counts().items() if k in self.requests and n > self.allowed_invoices(k)}

    def report_cut_short(self, key: str) -> bool:
        """A worker sent the invoice, the broker then got its ack, and the worker ended before it could report.

        The report must come after the ack, so no worker can make it survive that crash: allowed. (No
        clock race: that worker sent the ack only after its invoice was recorded, and nobody invoiced it later.)
        """
        invoices = self.invoices(key)
        if not invoices or invoices[-1].pid not in self.ended:
            return False
        last = invoices[-1]
        acks = self.watch.of(self.requests[key].seq)
        return any(a.kind in ("ack", "term") and a.ts >= last.ts for a in acks)

    def redelivered_after(self, key: str, ts: float, pid: int) -> Event | None:
        """The first call for that request by another process after ts: proof the broker delivered it again."""
        for event in self.run.log.events("effect", "send_invoice"):
            if event.key == key and event.ts > ts and event.pid != pid:
                return event
        for crash in self.crashes():
            if crash.key == key and crash.ts > ts and crash.pid != pid:
                return crash
        return None

    # --- the phases' waits -----------------------------------------------------------------------

    async def run_until_drained(self) -> Child | None:
        """Release workers one after another (one that dies is replaced) until the durable is drained, or
        the deadline; return the one running at the end (rule 2 is judged on a live worker)."""
        current = await self.spawns.release()
        deadline = time.monotonic() + MAIN_DEADLINE
        while current is not None:
            until = functools.partial(self._ended_or_finished, current)
            await self.run.wait_for(until, max(0.0, deadline - time.monotonic()))
            if not gone(current) or time.monotonic() >= deadline:
                break
            await self.spawns.stop(current)
            current = await self.spawns.release()  # also when all is done
        return current

    async def wait_idle_proof(self, current: Child | None) -> tuple[Child | None, float, Any]:
        """After the backlog drained, wait for the broker to see the worker ask again after an empty fetch
        (BrokerWatch.refetched_after_idle); return (worker, idle since, that pull or None)."""
        idle_since = self.watch.acks[-1].ts if self.watch.acks else time.time()
        refetch = None
        while self.drained_at and current is not None:
            child = current
            since = idle_since

            def proof(child: Child = child, since: float = since) -> bool:
                return self.watch.refetched_after_idle(since) is not None or gone(child)

            await self.run.wait_for(proof, IDLE_DEADLINE)
            refetch = self.watch.refetched_after_idle(idle_since)
            if not (child.died and child.died.get("error") in SERVICE_ERRORS) or len(self.workers) >= MAX_WORKERS:
                break
            # It died of the last request's refusal just as the queue ran dry (rule 3 fails it for
            # that): rule 2 is about surviving an empty queue, so it is judged on the next worker.
            await self.spawns.stop(child)
            current = await self.spawns.release()
            idle_since = time.time()
        return current, idle_since, refetch

    def late_done(self, child: Child, late: str) -> bool:
        seq = self.requests[late].seq
        return gone(child) or bool(self.invoices(late) and self.watch.settled_on_broker(seq) and not self.reports_due())

    def reports_due(self) -> bool:
        """A live worker sent an invoice whose env.settled has not arrived yet: it may be on its way."""
        alive = {c.pid for c in self.workers if c.alive}
        last: dict[str, Event] = {}
        for event in self.run.log.events("effect"):
            if event.name in ("send_invoice", "settled") and event.detail.get("outcome", "sent") == "sent":
                last[event.key or ""] = event
        return any(e.name == "send_invoice" and e.pid in alive for e in last.values())

    async def _ended_or_finished(self, child: Child) -> bool:
        return gone(child) or await self.finished()

    async def finished(self) -> bool:
        """Drained (and the reports in, or their grace over), or stalled; notes when it was first drained."""
        if rules.drained(await TOPOLOGY.info(self.run)):
            self.clean_since = self.clean_since or time.monotonic()
            if not self.reports_due() or time.monotonic() - self.clean_since > REPORT_GRACE:
                self.drained_at = self.drained_at or time.time()
                return True
            return False
        self.clean_since = self.drained_at = 0.0
        return self.stalled()

    def stalled(self) -> bool:
        """Waiting longer only adds evidence of the same fault: all was tried, and something keeps coming back."""
        counts = self.counts()
        if not all(counts.get(k) for k in self.keys("normal", "transient")):
            return False
        retried = any(
            len(self.calls("send_invoice", k)) > 2 + self.held_and_lost(k, self.calls("send_invoice", k))
            for k in self.keys("refused")
        )
        return (retried or bool(self.unexplained())) and not self.reports_due()

    async def slow_invoice(self, current: Child | None) -> Child | None:
        """The big invoice: the service takes longer than ack_wait over it while the grader, as a second worker of
        the group, asks the durable for work. A worker that keeps its claim leaves that worker nothing to take."""
        planned = rules.Planned(
            f"make the invoicing service take {self.plan.slow:.2f} s (longer than ack_wait, {ACK_WAIT:.1f} s) over"
            " one invoice while another worker of the group asks for work",
            "every request your worker takes must go to env.send_invoice, one call per request",
        )
        self.run.planned.append(planned)
        if current is None or gone(current):
            if current is not None:
                await self.spawns.stop(current)
            current = await self.spawns.release()
        await self.publish(["slow"])
        key = self.keys("slow")[0]
        if current is None:
            planned.seen = "no worker was left to run"
            return None
        child = current
        await self.run.wait_for(lambda: bool(self.calls("send_invoice", key)) or gone(child), LATE_DEADLINE)
        if not self.invoices(key):
            planned.seen = f"no worker of yours had called env.send_invoice for {key} {LATE_DEADLINE:.0f} s later"
            return current
        planned.fired = True
        seq = self.requests[key].seq
        deadline = time.monotonic() + self.plan.slow + LATE_DEADLINE
        sub = await self.run.js.pull_subscribe_bind(DURABLE, STREAM)

        def done() -> bool:
            return gone(child) or bool(self.watch.settled_on_broker(seq) and not self.reports_due())

        held: Any = None
        try:  # the colleague: takes what the broker hands it, and never invoices it
            while time.monotonic() < deadline and held is None and not done():
                try:
                    msgs = await sub.fetch(1, timeout=COLLEAGUE_PULL)
                except TimeoutError:
                    continue
                for msg in msgs:
                    if msg.metadata.sequence.stream == seq:
                        self.taken.append((time.time(), msg.metadata.num_delivered))
                        held = msg
            # It keeps what it took claimed until your worker's ack settles it, so the lost claim costs nothing
            # beyond this check's evidence (rule 7): no third delivery, no second invoice of yours.
            while held is not None and time.monotonic() < deadline and not done():
                await held.in_progress()
                await self.run.wait_for(done, COLLEAGUE_PULL)
        finally:
            await sub.unsubscribe()
        await self.run.wait_for(done, max(0.0, deadline - time.monotonic()))
        return current

    # --- traces ---------------------------------------------------------------------------------

    def trace(self, key: str, invoices: Collection[Event] = ()) -> list[str]:
        """What happened to one request, one line per event, with the worker's pid and the broker's view.

        A long trace is cut, but never at the lines of `invoices`: a check whose message counts invoices
        passes the very events it counted, so its trace shows every invoice it counts.
        """
        request = self.requests.get(key)
        steps = Trace(self.run, TRACE_LINES)
        if request is not None:
            steps.add(request.published, "published")
        ids = {event.id for event in invoices}
        for event in self.run.log.events():
            if event.key != key:
                continue
            who = f"worker {event.pid}"
            if event.kind == "effect" and event.name == "send_invoice":
                outcome = event.detail.get("outcome")
                text = {
                    "sent": f"{who} called env.send_invoice: invoice sent",
                    "unavailable": f"{who} called env.send_invoice: it raised ServiceUnavailable, nothing sent",
                    "refused": f"{who} called env.send_invoice: it raised AccountClosed, nothing sent",
                }.get(str(outcome), f"{who} called env.send_invoice")
                steps.add(event.ts, text, pin=event.id in ids)
            elif event.kind == "effect" and event.name == "settled":
                had = "the broker had its ack" if event.detail.get("acked") else "the broker had NO ack for it yet"
                had = had if event.detail.get("confirmed") or event.detail.get("acked") else "no ack seen for it yet"
                steps.add(event.ts, f"{who} called env.settled ({had})")
            elif event.kind == "effect" and event.name == "invoice_done":
                steps.add(event.ts, f"{who}'s env.send_invoice returned: the invoicing service was done")
            elif event.kind == "effect" and event.name == "reject":
                steps.add(event.ts, f"{who} called env.reject")
            elif event.kind == "crash" and event.name == "reject":
                steps.add(event.ts, f"{who} SIGKILLed by the grader right before env.reject")
            elif event.kind == "crash":
                kind = next(k for k, spot in KINDS.items() if spot == (event.name, event.detail.get("when")))
                steps.add(event.ts, f"{who} SIGKILLed by the grader {WHERE[kind]}")
        if request is not None:
            for ack in self.watch.of(request.seq):
                if ack.kind == "progress" and request.kind != "slow":
                    continue
                steps.add(ack.ts, f"broker got {an(ack.kind)} for delivery #{ack.delivered}")
            if request.kind == "slow":
                for ts, delivered in self.taken:
                    steps.add(ts, f"broker handed it to another worker of the group (delivery #{delivered})")
        return steps.lines(pinned_are="the invoices")


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults, phase by phase, and judge the invariants."""
    plan = Plan.draw(run.seed)
    await TOPOLOGY.provision(run.js, run.names)
    lab = Billing(run, await TOPOLOGY.watch(run, AckWatch), plan)
    phase = Phases(run)
    lab.spawns.prepare(len(plan.crashes) + 1)
    try:
        async with phase("crash incarnations"):  # each gets fresh requests and runs until its planned crash
            for _ in plan.crashes:
                await lab.publish(["normal"] * FRESH)
                child = await lab.spawns.release()
                assert child is not None
                await run.wait_for(functools.partial(gone, child), CRASH_DEADLINE)
                await lab.spawns.stop(child)
        async with phase("last incarnation"):  # the requests the service has trouble with, until drained
            await lab.publish(plan.final)
            current = await lab.run_until_drained()
            info = await TOPOLOGY.info(run)  # the main phase's end: what is stuck now stays stuck
        async with phase("idle"):  # rule 2: the running worker survives an empty fetch...
            current, idle_since, refetch = await lab.wait_idle_proof(current)
        async with phase("late request"):  # ... and takes a request that comes later
            late_at = time.time()
            await lab.publish(["late"])
            late = lab.keys("late")[0]
            if current is not None:
                await run.wait_for(functools.partial(lab.late_done, current, late), LATE_DEADLINE)
        async with phase("slow invoice"):  # longer than ack_wait, with another worker of the group asking for work
            await lab.slow_invoice(current)
    finally:
        await lab.spawns.cancel()
    await lab.spawns.settle()  # so the platform's rule-3 check sees a process that ended on its own
    if not lab.reject_kill.fired:
        lab.reject_kill.seen = "no worker of yours called env.reject"
    proof = rules.IdleProof(late, late_at, idle_since, bool(lab.drained_at), refetch, IDLE_DEADLINE, LATE_DEADLINE)
    handled_by = [e.pid for e in lab.invoices(late)]
    return [
        _lost_check(lab, info),
        _duplicate_check(lab),
        _settled_check(lab),
        _refused_check(lab),
        _spaced_check(lab),
        _claim_check(lab),
        _acked_check(lab, info),
        rules.survives_idle(run.at, proof, current, handled_by, lab.trace(late), IDLE_WORDS),
        _guarantees_check(lab),
        run.workload_check("invoice"),
    ]


IDLE_WORDS = rules.IdleWords(
    title="the running worker survives an empty queue and invoices a request that arrives later",
    done="invoiced",
    hint_no_refetch="after an empty fetch, fetch again: the loop must keep asking for requests",
    hint_slow="keep fetching from the durable and invoice each request as it comes",
    failures=SERVICE_ERRORS,
)


# --- the checks ---------------------------------------------------------------------------------


def _deaths(lab: Billing) -> list[Child]:
    return [c for c in lab.workers if c.unplanned]


def _lost_check(lab: Billing, info: Any) -> Check:
    title = "every request the invoicing service can take is invoiced, whatever crashed (none lost)"
    keys = lab.keys("normal", "transient", "slow")
    counts = lab.counts()
    lost = [k for k in keys if not counts.get(k)]
    if not lost:
        return Check("no_lost_invoices", title, True)
    run, watch = lab.run, lab.watch

    def cause(key: str) -> tuple[int, str, str]:
        """(priority, evidence, hint) for one lost request; the lowest priority is the clearest."""
        request = lab.requests[key]
        settled = watch.settled_on_broker(request.seq)
        crash = next((e for e in lab.crashes() if e.key == key and e.name == "send_invoice"), None)
        failed = lab.calls("send_invoice", key, "unavailable")
        rejected = lab.calls("reject", key)
        tries = [e.ts for e in failed[:1]] + ([crash.ts] if crash is not None else [])
        if settled is not None and tries and settled.ts <= min(tries):
            what = (
                f"the grader killed worker {crash.pid} at {run.at(crash.ts)}, before the invoice went out,"
                if crash is not None and crash.ts <= min(tries)
                else f"env.send_invoice then raised ServiceUnavailable ({run.at(failed[0].ts)}),"
            )
            return (
                0 if crash is not None and crash.ts <= min(tries) else 1,
                f"{key}: the broker got {an(settled.kind)} for it at {run.at(settled.ts)}, before any invoice went"
                f" out; {what} and the broker never delivered it again: it had been told the request was done."
                " Acking before the work is at-most-once.",
                "let the broker hear the ack only once the invoice has gone out: a crash or a failure before it then"
                " means a redelivery, not a lost invoice",
            )
        if failed and (rejected or settled is not None):
            first = failed[0]
            how = (
                f"your worker reported it to the billing team with env.reject at {run.at(rejected[0].ts)}"
                if rejected
                else f"the broker got {an(settled.kind)} for it at {run.at(settled.ts)}"
            )
            return (
                2,
                f"{key}: env.send_invoice raised ServiceUnavailable at {run.at(first.ts)} ('{_unavailable_text(key)}'),"
                f" and {how}, so it never came back. The same request would have gone through"
                f" {request.outage:.2f} s after its first try.",
                "ServiceUnavailable says 'not now', not 'never': leave that request unacked (or nak it) so the broker"
                " delivers it again, and invoice it then",
            )
        if settled is None:
            return (
                3,
                f"{key} was still not invoiced when the run ended; the durable still held {info.num_ack_pending}"
                f" unacked and {info.num_pending} undelivered messages.",
                "keep fetching: every request that is not acked comes back after ack_wait, and must be invoiced then",
            )
        return (
            4,
            f"{key} was acked at {run.at(settled.ts)} without an invoice.",
            "ack a request only after env.send_invoice returned for it",
        )

    ranked = sorted((cause(k), k) for k in lost)
    (_, evidence, hint), key = ranked[0]
    message = f"{len(lost)} of {len(keys)} requests the invoicing service could take were never invoiced: "
    message += f"{', '.join(lost)}.\n{evidence}"
    deaths = _deaths(lab)
    if deaths:
        message += f"\nYour worker also {how_ended(deaths[0])}; {plural(len(deaths), 'time')} in all."
    return Check("no_lost_invoices", title, False, message, trace=[*lab.trace(key), "never invoiced"], hint=hint)


def _duplicate_check(lab: Billing) -> Check:
    title = "an invoice goes out again only where a worker that sent it died before the broker had its ack"
    extra = lab.unexplained()
    if not extra:
        return Check("duplicates_only_after_crash", title, True)
    key = next(iter(extra))
    run, request = lab.run, lab.requests[key]
    # One source for the count and the trace: the message counts these events, the trace pins their lines.
    invoices = lab.invoices(key)
    pids = sorted({e.pid for e in invoices})
    allowed = lab.allowed_invoices(key)
    message = (
        f"{plural(len(extra), 'request')} {'was' if len(extra) == 1 else 'were'} invoiced more often than the"
        f" crashes explain: {key} went out {len(invoices)} times"
        f" (by worker{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}), allowed {allowed}"
    )
    excused = [pid for pid in lab.ended if lab.held_and_lost(key, [e for e in invoices if e.pid == pid])]
    message += (
        f": once, plus once for worker {', '.join(map(str, excused))}, which ended before the broker had the ack."
        if excused
        else ": once (no worker that sent it ended before the broker had its ack)."
    )
    acks = [a for a in lab.watch.of(request.seq) if a.kind in ("ack", "term")]
    first = f"; its first ack came at {run.at(acks[0].ts)}, for delivery #{acks[0].delivered}." if acks else ""
    message += (
        f"\nEvery other time the broker delivered it again because no ack for that delivery arrived within ack_wait"
        f" ({ACK_WAIT:.1f} s){first or '; it never got one.'}"
    )
    if not any(a.kind in ("ack", "term") for a in lab.watch.acks):
        hint = "ack each request once its invoice went out, on the durable env.durable('invoicer')"
    elif not acks or min(a.delivered for a in acks) > 1 + len(excused):
        hint = (
            f"{key}'s earlier deliveries never got an ack of their own: JetStream acks each message by itself (an ack"
            " of another message, such as the last of a batch, does not cover it)"
        )
    else:
        hint = (
            "an ack that comes after ack_wait is too late: the broker has already given the request out again; ack"
            " each request within ack_wait of its delivery"
        )
    trace = lab.trace(key, invoices)
    return Check("duplicates_only_after_crash", title, False, message, trace=trace, hint=hint)


def _settled_check(lab: Billing) -> Check:
    title = "every invoice reaches the billing dashboard, and only once the broker has its ack (settled after the ack)"
    run, watch = lab.run, lab.watch
    reports = lab.calls("settled")
    phantom = [e for e in reports if e.key in lab.requests and not any(i.ts <= e.ts for i in lab.invoices(e.key))]
    unseen = [e for e in reports if e.key in lab.requests and e.detail.get("acked") is False and e not in phantom]
    early = [e for e in unseen if e.detail.get("confirmed")]  # no ack within ACK_PATIENCE: proven early
    came_back: list[tuple[Event, Event]] = []
    for crash in lab.crashes():
        if crash.name == "settled" and any(e.key == crash.key and e.pid == crash.pid for e in unseen):
            again = lab.redelivered_after(crash.key or "", crash.ts, crash.pid)
            if again is not None:
                came_back.append((crash, again))
    missing = [
        k
        for k in lab.keys("normal", "transient", "late", "slow")
        if lab.invoices(k) and not lab.calls("settled", k) and not lab.report_cut_short(k)
    ]
    if not (phantom or early or came_back or missing):
        return Check("settled_after_ack", title, True)
    if early or came_back:  # both are proof: no ack arrived while the process waited, or the request came back
        report = next((e for e in unseen if came_back and e.key == came_back[0][0].key), (early or unseen)[0])
        key = report.key or ""
        ack = watch.settled_on_broker(lab.requests[key].seq)
        waited = (
            f": the grader's own connection receives a copy of every ack the broker gets, and none came while your"
            f" process waited {ACK_PATIENCE:.1f} s in that call"
            if report.detail.get("confirmed")
            else ""
        )
        message = (
            f"env.settled came before the broker had the ack (at {len(unseen)} of your {len(reports)} reports the"
            " grader had seen no ack for that request)."
            f"\nenv.settled({key!r}) arrived at {run.at(report.ts)}; the broker had no ack for {key} then{waited}"
            + (f" (the first ack for it reached the broker at {run.at(ack.ts)})." if ack else ".")
        )
        for crash, again in came_back[:1]:
            message += (
                f"\nThe grader killed worker {crash.pid} right after env.settled({crash.key!r}) at {run.at(crash.ts)};"
                f" the broker delivered {crash.key} again and worker {again.pid} took it at {run.at(again.ts)}: the"
                " dashboard had counted a request that came back."
            )
        # What followed the reports tells the cause apart: no ack for that delivery at all, an ack the worker
        # asked for only after reporting (ack_sync after settled), or an ack only queued when it reported.
        after = [_ack_after_report(lab, r) for r in unseen]
        followed = [a for a in after if a is not None]
        if not any(a.kind in ("ack", "term") for a in watch.acks):
            hint = (
                "the dashboard may count a request only once the broker has its ack: ack each request (with a call"
                " that returns once the server has recorded it) before you report it"
            )
        elif len(followed) * 2 < len(after):
            hint = (
                "most reported deliveries were never acked at all: JetStream acks each message by itself (an ack of"
                " another message, such as the last of a batch, does not cover it); ack each one, then report it"
            )
        elif sum(watch.was_confirmed(a) for a in followed) * 2 > len(followed):
            hint = "report to the dashboard after the broker has recorded the ack, not before you ask it to"
        else:
            hint = (
                "an ack call that returns at once has only queued the ack in your process; report only after a call"
                " that returns once the server has recorded it"
            )
        return Check("settled_after_ack", title, False, message, trace=lab.trace(key), hint=hint)
    if phantom:
        key = phantom[0].key or ""
        message = (
            f"env.settled({key!r}) told the dashboard an invoice was done at {run.at(phantom[0].ts)}, but no invoice"
            f" for {key} had gone out."
        )
        return Check(
            "settled_after_ack",
            title,
            False,
            message,
            trace=lab.trace(key),
            hint="report to the dashboard only requests whose env.send_invoice returned",
        )
    key = next((k for k in missing if any(c.key == k for c in lab.crashes())), missing[0])
    message = (
        f"{plural(len(missing), 'invoiced request')} never reported to the dashboard: {', '.join(missing)}. The"
        " billing dashboard counts invoices from env.settled, so it is now behind."
    )
    hint = "report every invoice that went out, once the broker has its ack"
    cut = next((c for c in lab.crashes() if c.key == key and c.name == "invoice_sent"), None)
    ack = watch.settled_on_broker(lab.requests[key].seq, before=cut.ts) if cut is not None else None
    if cut is not None and ack is not None:
        message += (
            f"\n{key}: the grader killed worker {cut.pid} right after its invoice went out ({run.at(cut.ts)}), and"
            f" the broker never delivered it again: it had its ack already ({run.at(ack.ts)}), before the work was"
            " finished."
        )
        hint = "ack only once the invoice went out: a crash before the ack then brings the request back to finish it"
    return Check("settled_after_ack", title, False, message, trace=lab.trace(key), hint=hint)


def _ack_after_report(lab: Billing, report: Event) -> Any:
    """The first ack of the reported request after the report and before it was invoiced again, if any."""
    key = report.key or ""
    again = [e.ts for e in lab.calls("send_invoice", key) if e.ts > report.ts]
    until = again[0] if again else float("inf")
    acks = lab.watch.of(lab.requests[key].seq)
    return next((a for a in acks if a.kind in ("ack", "term") and report.ts <= a.ts < until), None)


def _refused_check(lab: Billing) -> Check:
    title = "a request the invoicing service will never take is reported with env.reject, not retried, and settled"
    run = lab.run
    for key in lab.keys("refused"):
        request = lab.requests[key]
        attempts = lab.calls("send_invoice", key)
        reports = lab.calls("reject", key)
        explained = lab.held_and_lost(key, attempts + reports)
        settled = lab.watch.settled_on_broker(request.seq)
        said = f"AccountClosed('{_closed_text(key, request.customer)}')"
        span = f" over {attempts[-1].ts - attempts[0].ts:.1f} s" if len(attempts) > 1 else ""
        if not reports and settled is None:
            message = (
                f"the invoicing service refused {key} {plural(len(attempts), 'time')}{span} with {said}, and your"
                f" worker let it come back every time; it was never reported, and the broker still holds it."
            )
            hint = (
                "no retry can fix a closed account: report it with env.reject(order_id, reason) and settle the"
                " message so it stops coming back"
            )
        elif not reports:
            message = (
                f"the invoicing service refused {key} with {said}; the broker got {an(settled.kind)} for it at"
                f" {run.at(settled.ts)}, but env.reject was never called: nobody in billing will ever hear of it."
            )
            hint = "report a request that can never be invoiced with env.reject(order_id, reason) before you settle it"
            kill = next((c for c in lab.crashes() if c.key == key and c.name == "reject"), None)
            if kill is not None and settled.ts <= kill.ts:
                message += (
                    f"\nThe grader killed worker {kill.pid} right before its env.reject call ({run.at(kill.ts)}): the"
                    f" broker had the {settled.kind} already, so nothing brought {key} back to be reported. Settling"
                    " first makes a kill between the two lines lose the report."
                )
                hint = (
                    "report first, then settle: a kill between the two then leaves the request on the broker, and it"
                    " comes back to be reported"
                )
        elif settled is not None and settled.ts < reports[0].ts:
            message = (
                f"your worker settled {key} on the broker ({an(settled.kind)} at {run.at(settled.ts)}) before it"
                f" reported it with env.reject ({run.at(reports[0].ts)}): a kill between the two lines would leave the"
                " billing team never hearing of it."
            )
            hint = (
                "report first, then settle: a kill between the two then leaves the request on the broker, and it comes"
                " back to be reported"
            )
        elif len(attempts) > 1 + explained and reports[0].ts < attempts[1].ts:
            message = (
                f"your worker reported {key} with env.reject at its first refusal, but did not settle that delivery:"
                f" the broker delivered it again, and it was tried {plural(len(attempts), 'time')}{span} and reported"
                f" {plural(len(reports), 'time')}"
                + (f"; it was settled only at {run.at(settled.ts)}." if settled else "; it is still not settled.")
            )
            hint = "once it is reported, settle that delivery (ack it, or term it) so the broker stops delivering it"
        elif settled is None:
            message = (
                f"your worker reported {key} with env.reject, but never settled it: the broker still holds it for"
                " redelivery."
            )
            hint = "once it is reported, settle the message (ack it, or term it) so the broker stops delivering it"
        elif len(attempts) > 1 + explained:
            message = (
                f"the invoicing service refused {key} {plural(len(attempts), 'time')}{span}, every time with {said};"
                " your worker tried it again before reporting it"
                + (f" (a crash explains {explained} of the retries)." if explained else ".")
            )
            hint = (
                "an error that says the request can never succeed will say so on every try: report it at the first"
                " refusal instead of counting attempts"
            )
        elif len(reports) > 1 + explained:
            message = f"{key} was reported with env.reject {len(reports)} times; a crash explains {explained}."
            hint = "report a refused request once, then settle it"
        else:
            continue
        return Check("refused_requests_reported", title, False, message, trace=lab.trace(key), hint=hint)
    return Check("refused_requests_reported", title, True)


def _spaced_check(lab: Billing) -> Check:
    """No hot loop: a try the service answered with ServiceUnavailable is followed by the next one no sooner than
    MIN_RETRY_GAP. The grader records a try when it answers it, before the worker can nak or wait: load only
    widens the gaps it sees (rule 8)."""
    title = f"a request the service cannot take now is tried again no sooner than {MIN_RETRY_GAP:.1f} s later"
    worst: tuple[int, str, list[float], float] | None = None  # (tries, key, quick gaps, span)
    for key in lab.keys("transient"):
        tries = lab.calls("send_invoice", key)
        gaps = [
            b.ts - a.ts
            for a, b in itertools.pairwise(tries)
            if a.detail.get("outcome") == "unavailable" and not _claim_lapsed(lab, key, a.ts, b.ts)
        ]
        quick = [g for g in gaps if g < MIN_RETRY_GAP]
        if quick and (worst is None or len(tries) > worst[0]):
            worst = (len(tries), key, quick, tries[-1].ts - tries[0].ts)
    if worst is None:
        return Check("retries_spaced", title, True)
    count, key, quick, span = worst
    message = (
        f"{key} was tried {count} times in {span:.2f} s while the invoicing service was restarting (it answered"
        f" '{_unavailable_text(key)}'); {len(quick)} of those tries came less than {MIN_RETRY_GAP:.1f} s after the"
        f" refusal before them, the quickest {min(quick) * 1000:.1f} ms after it. A hot loop of retries keeps a"
        " restarting service busy answering 'not now'."
    )
    hint = (
        f"give a request the service cannot take now some time before its next try (at least {MIN_RETRY_GAP:.1f} s"
        " here): a redelivery after a delay, or after ack_wait, instead of one right away"
    )
    return Check("retries_spaced", title, False, message, trace=lab.trace(key), hint=hint)


def _claim_lapsed(lab: Billing, key: str, before: float, after: float) -> bool:
    """The try at `after` was made on a delivery the server sent before the worker answered the one it had
    tried at `before`: its claim ran out (ack_wait) while a loaded machine held the worker, and the broker,
    not the code, chose when to hand the request over again. A redelivery after the worker's nak is the
    code's choice (its delay), and so is a second try within one delivery."""
    seq = lab.requests[key].seq
    sent = [(n, ts) for n, ts in lab.watch.sent(seq) if ts <= after]
    if len(sent) < 2 or sent[-1][1] <= before:
        return False
    n, ts = sent[-1]
    answered = [a.ts for a in lab.watch.of(seq) if a.delivered == n - 1 and a.kind in ("ack", "nak", "term")]
    return not answered or min(answered) > ts


def _claim_check(lab: Billing) -> Check:
    """The big invoice kept its claim: while the service worked on it, the broker did not deliver it again."""
    title = "an invoice that takes longer than ack_wait keeps its claim: nobody else is handed it meanwhile"
    slow = lab.keys("slow")
    if not slow or not lab.invoices(slow[0]):
        return Check("keeps_claim", title, True)  # never tried: rule 1 (faults_fired) says so
    key = slow[0]
    run, request = lab.run, lab.requests[key]
    first = lab.invoices(key)[0]
    done = [e for e in lab.calls("invoice_done", key) if e.pid == first.pid]
    until = done[0].ts if done else float("inf")
    again = [e for e in lab.calls("send_invoice", key) if first.ts < e.ts < until]
    if not lab.taken and not again:
        return Check("keeps_claim", title, True)
    theirs = {delivered for _, delivered in lab.taken}  # the colleague's own signs are not your worker's
    beats = [
        a
        for a in lab.watch.of(request.seq)
        if a.kind == "progress" and first.ts <= a.ts <= until and a.delivered not in theirs
    ]
    signs = f"only {plural(len(beats), 'sign')} that it was still on it" if beats else "no sign that it was still on it"
    message = (
        f"the invoicing service took {request.takes:.2f} s over {key}'s invoice (ack_wait is {ACK_WAIT:.1f} s); your"
        f" worker {first.pid} started it at {run.at(first.ts)} and sent the broker {signs} while it waited."
    )
    if lab.taken:
        ts, delivered = lab.taken[0]
        message += (
            f"\nAt {run.at(ts)} the broker handed {key} (delivery #{delivered}) to another worker of the group that"
            " asked for work (the grader's own): that worker would invoice it a second time."
        )
        later = [a for a in lab.watch.of(request.seq) if a.kind in ("ack", "term") and a.ts > ts]
        if later:
            message += (
                f" Your worker's ack at {run.at(later[0].ts)} then settled that other worker's delivery too: had that"
                " worker died before invoicing, nobody would ever invoice it."
            )
    else:
        message += (
            f"\nYour worker called env.send_invoice({key!r}) again at {run.at(again[0].ts)}, while its first call was"
            " still running: the broker had delivered it again."
        )
    hint = (
        "while a call that takes longer than ack_wait runs, tell the broker every so often (well within ack_wait)"
        " that the request is still yours, from alongside the call: a sign sent only before or after it comes too late"
    )
    return Check("keeps_claim", title, False, message, trace=lab.trace(key), hint=hint)


def _acked_check(lab: Billing, info: Any) -> Check:
    stuck = [
        r.key
        for r in lab.requests.values()
        if r.kind not in ("late", "slow") and lab.watch.settled_on_broker(r.seq) is None
    ]
    refused = [k for k in stuck if lab.requests[k].kind == "refused"]
    hint = "ack each request once its invoice went out, on the durable env.durable('invoicer')"
    if refused and len(stuck) == len(refused):
        hint = f"{refused[0]} can never be invoiced: once it is reported, ack or term it so it stops coming back"
    trace = lab.trace(stuck[0]) if stuck else []
    return rules.drained_check(info, DURABLE, ACK_WAIT, noun="request", stuck=stuck, hint=hint, trace=trace)


def _guarantees_check(lab: Billing) -> Check:
    title = "GUARANTEES names the guarantee each worker in workers.py gives"
    given = lab.guarantees[0] if lab.guarantees else None
    if not isinstance(given, dict):
        return Check(
            "guarantees_named",
            title,
            False,
            f"GUARANTEES in your file is {given!r}, not a dict from worker name to guarantee.",
            hint=f"keep GUARANTEES a dict with the keys {', '.join(ANSWERS)}",
        )
    wrong = [(name, given.get(name)) for name in ANSWERS if given.get(name) != ANSWERS[name]]
    if not wrong:
        return Check("guarantees_named", title, True)
    name, got = wrong[0]
    return Check(
        "guarantees_named",
        title,
        False,
        f"{len(wrong)} of {len(ANSWERS)} workers are classified wrong; first: {name} is {got!r}.",
        hint=f"ask what a crash, or a failed call, at each line of {name} does to the message; the answer is one of "
        f"{AT_MOST_ONCE!r}, {AT_LEAST_ONCE!r}, {EFFECTIVELY_ONCE!r}, {NEITHER!r}",
    )
