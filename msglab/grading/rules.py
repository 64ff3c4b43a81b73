"""The platform's rules, each written once: every grader calls these instead of its own copy.

    faults_check       rule 1: a planned crash that did not fire fails the run, in the lab's words
                       (from the label the grader put on the Crash itself)
    deaths_check       rule 3: a learner process that ended on its own fails, quoting its traceback
    survives_idle      rule 2: the running worker outlives an empty queue and takes a late message
    Allowance          rule 6: how often an effect may happen, from the kills and the broker's acks
    drained            "the durable is drained": nothing undelivered, nothing unacked
    plural, an, squash the wording every verdict shares

Check ids are the platform's, the same in every lab: `faults_fired`, `no_unplanned_deaths`,
`survives_idle`. Their hints (levels 2 and 3) live once in `hints.toml` beside this file; a lab's
lab.toml overrides one only where the lab needs its own words.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from msglab.grading.verdict import Check

if TYPE_CHECKING:
    from msglab.grading.harness import Child
    from msglab.grading.observe import BrokerWatch, Pull

FAULTS_FIRED, NO_UNPLANNED_DEATHS, SURVIVES_IDLE = "faults_fired", "no_unplanned_deaths", "survives_idle"
PLATFORM_CHECKS = (FAULTS_FIRED, NO_UNPLANNED_DEATHS, SURVIVES_IDLE)


# --- wording --------------------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    """'1 invoice', '3 invoices'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def an(word: str) -> str:
    """'an ack', 'a nak'."""
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def squash(lines: list[str], keep: int = 14, pinned: Collection[int] = (), pinned_are: str = "") -> list[str]:
    """A trace cut to `keep` lines: its start and its last three steps, and how many were left out.

    No line whose index is in `pinned` goes (a check's message counts those steps): the cut takes the others
    only, and one line where it begins says how many went and that `pinned_are` (which lines) all still show.
    Pinned lines alternate with others (an invoice, its report), so one such line per gap would save nothing.
    """
    if len(lines) <= keep:
        return lines
    loose = [i for i in range(len(lines)) if i not in pinned]
    if len(loose) == len(lines):
        return [*lines[: keep - 4], f"... {len(lines) - keep + 1} more steps ...", *lines[-3:]]
    room = max(0, keep - 1 - (len(lines) - len(loose)))  # loose steps beside the pinned and the cut's line
    tail = min(3, room // 2)
    gone = set(loose[room - tail : len(loose) - tail])
    first = min(gone, default=-1)
    kept = []
    for i, line in enumerate(lines):
        if i == first:
            kept.append(f"... {len(gone)} more steps from here on, not shown ({pinned_are} all are) ...")
        if i not in gone:
            kept.append(line)
    return kept


def how_ended(child: Child) -> str:
    """How a learner process ended, in a phrase ('raised KeyError(...) at line 40', 'returned on its own')."""
    if child.died:
        said = str(child.died.get("message"))
        said = said if len(said) <= 120 else said[:117] + "..."
        where = f" at {child.died.get('where')}" if child.died.get("where") else ""
        return f"raised {child.died.get('error')}({said}){where}"
    if child.returned:
        return "returned on its own"
    return child.how_it_ended()


# --- rule 1: planned faults fired ------------------------------------------------------------------

FAULTS_TITLE = "every planned crash happened (the grader could test what your code does after one)"


@dataclass
class Planned:
    """A planned fault that is not a crash (a stream that refuses a publish, a service that stalls).

    The grader appends it to `run.planned` when it plans it and sets `fired` when it happened;
    `seen` says what the code did instead, for the verdict (set it when the fault did not fire).
    """

    what: str  # what the grader planned, e.g. "make the DLQ stream refuse your first dead letter"
    hint: str
    fired: bool = False
    seen: str = ""  # e.g. "worker 4321 published no dead letter with JetStream"


def faults_check(children: Iterable[Child], planned: Iterable[Planned] = ()) -> Check:
    """Rule 1: every planned crash (and every other planned fault) fired; a run whose faults did not
    happen cannot pass.

    Worded from the Crash's own labels (`Crash.point`, `Crash.counted`, `Crash.hint`), so a lab
    says "on the invoice it sent #2" instead of the effect the grader counts internally.
    """
    missing = [(c, f) for c in children for f in c.faults if f not in c.fired]
    other = next((p for p in planned if not p.fired), None)
    if not missing and other is None:
        return Check(FAULTS_FIRED, FAULTS_TITLE, True)
    if not missing and other is not None:
        message = (
            f"the grader planned to {other.what}{', but ' + other.seen if other.seen else ''}. Without the fault"
            " this run proves nothing about surviving it, so it cannot pass."
        )
        return Check(FAULTS_FIRED, FAULTS_TITLE, False, message, hint=other.hint)
    child, crash = missing[0]
    made = child.calls.get(crash.effect, 0)
    how = f" and then {how_ended(child) if crash.point else child.how_it_ended()}" if child.unplanned else ""
    if crash.point:
        intent = f"the grader planned to kill your {child.role.replace('_', ' ')} process {child.pid} {crash.point}"
        counted = plural(made, crash.counted or f"{crash.effect} call")
    else:
        intent = f"the grader planned to {crash.describe()} in your {child.role} process {child.pid}"
        counted = f"{made} {crash.effect} call(s)"
    message = (
        f"{intent}, but that process made only {counted}{how}. Without the crash this run proves nothing about"
        " surviving one, so it cannot pass."
    )
    hint = crash.hint or (
        f"every message your {child.role} takes must go through {crash.effect}, one call per message, "
        "while the process keeps running"
    )
    return Check(FAULTS_FIRED, FAULTS_TITLE, False, message, hint=hint)


# --- rule 3: no unplanned deaths -------------------------------------------------------------------


def deaths_check(children: Iterable[Child]) -> Check:
    """Rule 3: learner processes die only when the grader kills them; quote the traceback."""
    title = "your processes keep running until the grader stops them (no crash of their own)"
    dead = [c for c in children if c.unplanned or c.protocol_error]
    if not dead:
        return Check(NO_UNPLANNED_DEATHS, title, True)
    child = dead[0]
    message = f"your {child.role} process {child.pid} {child.how_it_ended()}."
    trace: list[str] = []
    if child.died and child.died.get("traceback"):
        trace = [line for line in child.died["traceback"].splitlines() if line.strip()][-12:]
    hint = "a worker runs until it is stopped: an empty queue or a failed message is no reason to return or raise"
    if child.protocol_error:
        hint = "leave the grader's channels alone: print to stdout/stderr as you like, but do not write to other fds"
    elif child.died:
        hint = "handle the failure where it happens (or let the message be redelivered); never let it end the worker"
    return Check(NO_UNPLANNED_DEATHS, title, False, message, trace=trace, hint=hint)


# --- rule 2: a worker survives an empty queue -------------------------------------------------------


@dataclass
class IdleProof:
    """What the grader saw around the late message: the evidence rule 2 is judged on.

    `since`: when the backlog was gone (the last ack); `refetch`: the pull proving the worker
    asked again after an empty fetch (BrokerWatch.refetched_after_idle), None if it never did;
    `late_at`: when the grader published the late message; `drained`: the backlog did drain.
    """

    late: str  # the late message's key, as the lab names it (an order id, ...)
    late_at: float
    since: float
    drained: bool
    refetch: Pull | None
    idle_deadline: float  # how long the grader waited for the refetch
    late_deadline: float  # how long the worker had for the late message


@dataclass
class IdleWords:
    """The lab's words for rule 2: what the worker does to a message, and the hints it fits."""

    title: str  # e.g. "the running worker survives an empty queue and invoices a request that arrives later"
    done: str  # the verb, past participle: "invoiced"
    hint_ended: str = "a worker runs until it is stopped: an empty fetch means 'ask again', not 'done'"
    hint_failure: str = "handle each failure where it happens; never let it end the worker"
    hint_no_refetch: str = "after an empty fetch, fetch again: the loop must keep asking for messages"
    hint_slow: str = "keep fetching from the durable and handle each message as it comes"
    failures: tuple[str, ...] = field(default=())  # error names a lab's service raises: a death by one is a failure
    # Why this run could not test rule 2 (the backlog never drained, the late message never reached the
    # durable), in the lab's words: then the check fails saying so, whatever the worker did.
    untested: str = ""
    hint_untested: str = "make the lab's other checks pass first: this one needs a drained backlog and a late message"


def survives_idle(
    at: Any, proof: IdleProof, current: Child | None, handled_by: list[int], trace: list[str], words: IdleWords
) -> Check:
    """Rule 2: after the backlog drained and the worker asked again after an empty fetch, the late
    message is handled by the worker already running (`handled_by`: pids that handled it).

    `at` formats a grader timestamp for the verdict (Run.at).
    """
    if words.untested:
        message = f"could not be tested: {words.untested}"
        return Check(SURVIVES_IDLE, words.title, False, message, trace=trace, hint=words.hint_untested)
    if current is not None and current.pid in handled_by:
        return Check(SURVIVES_IDLE, words.title, True)
    late = proof.late
    if proof.drained and proof.refetch is not None:
        waited = (
            f"After the queue ran empty ({at(proof.since)}) and your worker asked again after an empty fetch"
            f" ({at(proof.refetch.ts)}), the grader published {late} at {at(proof.late_at)}"
        )
    elif proof.drained:
        waited = (
            f"After the queue ran empty ({at(proof.since)}) the grader waited for your worker to ask for more"
            f" and published {late} at {at(proof.late_at)}"
        )
    else:
        waited = f"The grader published {late} at {at(proof.late_at)}"
    if current is None:
        message, hint = f"{waited}, but no worker was left running: every one had ended.", words.hint_ended
    elif not current.alive or current.returned or current.died:
        message = f"{waited}, but your worker process {current.pid} had {how_ended(current)}."
        failed = current.died and current.died.get("error") in words.failures
        hint = words.hint_failure if failed else words.hint_ended
    elif proof.drained and proof.refetch is None:
        message = (
            f"{waited}; your worker sent no pull request for {proof.idle_deadline:.0f} s after the queue ran empty,"
            f" and {late} was not {words.done} within {proof.late_deadline:.0f} s."
        )
        hint = words.hint_no_refetch
    else:
        others = sorted(set(handled_by))
        message = f"{waited}; worker {current.pid} did not handle it within {proof.late_deadline:.0f} s" + (
            f" (worker {others[0]} did)." if others else "."
        )
        hint = words.hint_slow
    return Check(SURVIVES_IDLE, words.title, False, message, trace=trace, hint=hint)


# --- rule 6: duplicates only where a killed worker held the delivery --------------------------------


@dataclass
class Allowance:
    """How often one message's effect may happen, and the evidence for it.

    Once, plus once per worker process that did the effect and ended before the broker had an ack
    (or term) of that message: such a worker held a delivery the broker still owed, so the message
    comes back and is done again. Capped at the deliveries the broker itself reported (the largest
    `delivered` count among the acks it received): every extra effect needs a delivery of its
    own, so a process that repeats an effect without one (from memory, or from a file of its
    own) earns nothing. Lab 02 had no cap and counted such a process; lab 01 capped. The cap is
    right: the rule is about deliveries the broker redelivered, and only the broker can say how
    many there were. Without any ack (the broker reported nothing) there is no cap to apply.
    """

    allowed: int
    held: list[int]  # pids that did it and ended before the broker had its ack
    deliveries: int | None  # the most deliveries of it the broker reported in acks; None: no ack to tell


def held_and_lost(ended: dict[int, float], evidence: Iterable[Any], settled_before: Any) -> list[int]:
    """Processes (pid -> when they ended) whose calls in `evidence` (events with .pid and .ts) show
    they took the message, and that ended before `settled_before(ts)` (the broker's ack) was true."""
    events = list(evidence)
    return [
        pid
        for pid, end in ended.items()
        if any(e.pid == pid and e.ts <= end for e in events) and not settled_before(end)
    ]


def allowance(
    ended: dict[int, float],
    effects: Iterable[Any],
    watch: BrokerWatch,
    seqs: Iterable[int],
    moved_on: Callable[[int, float], bool] | None = None,
) -> Allowance:
    """Rule 6 for one message (its stream sequences `seqs`): see Allowance.

    `moved_on(pid, ts)`, if given, is true when that process went on to later work after its last
    effect on this message (at `ts`), e.g. to a message that did not exist yet then: it was no longer
    working on this one, so its end excuses nothing (an ack it held back is no crash's fault).
    """
    seqs = list(seqs)
    effects = list(effects)

    def settled_before(ts: float) -> bool:
        return any(a.stream_seq in seqs and a.kind in ("ack", "term") and a.ts <= ts for a in watch.acks)

    held = held_and_lost(ended, effects, settled_before)
    if moved_on is not None:
        last = {pid: max(e.ts for e in effects if e.pid == pid and e.ts <= ended[pid]) for pid in held}
        held = [pid for pid in held if not moved_on(pid, last[pid])]
    acks = [a for a in watch.acks if a.stream_seq in seqs]
    deliveries = max(a.delivered for a in acks) if acks else None
    allowed = 1 + len(held) if deliveries is None else max(1, min(1 + len(held), deliveries))
    return Allowance(allowed, held, deliveries)


# --- the durable is drained ------------------------------------------------------------------------


def drained(info: Any) -> bool:
    """The durable's consumer_info shows nothing undelivered and nothing delivered-but-unacked."""
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


ALL_ACKED = "all_acked"


def drained_check(
    info: Any,
    durable: str,
    ack_wait: float,
    *,
    noun: str = "message",
    stuck: list[str] | None = None,
    title: str = "",
    hint: str = "",
    trace: list[str] | None = None,
) -> Check:
    """ "The durable is drained" as a check (`all_acked`): nothing undelivered or unacked at the run's end.

    `info` is the durable's consumer_info then; `stuck` names what the lab knows is unsettled.
    """
    title = title or f"every {noun} ends acked (or terminated) on the durable '{durable}' (nothing stuck)"
    if drained(info):
        return Check(ALL_ACKED, title, True)
    stuck = stuck or []
    message = (
        f"the durable '{durable}' still has {info.num_pending} undelivered and {info.num_ack_pending}"
        f" delivered-but-unacked messages ({info.num_redelivered} redelivered) at the end of the run"
        + (f": {', '.join(stuck[:6])}{' ...' if len(stuck) > 6 else ''}." if stuck else ".")
        + f" Without an ack the broker delivers {an(noun)} again every {ack_wait:.1f} s, forever."
    )
    hint = hint or f"ack each {noun} once its work is done, on the durable env.durable('{durable}')"
    return Check(ALL_ACKED, title, False, message, trace=trace or [], hint=hint)
