"""The example lab's grader (examples/00_echo, walked through in docs/authoring.md): an echo worker.

Not part of the course. It shows what the platform leaves a lab to write: the effects its story
needs, the workload's phases, and its bespoke checks. Rules 1, 2, 3 and 6, "drained", held spawns,
traces and the wording come from msglab.grading.rules and msglab.grading.scaffold.

Workload (seeded): two crash incarnations, each killed on its n-th env.echo call (n from the seed),
one before the echo happens and one right after (order from the seed), then a last one that runs
until the durable is drained; then the idle proof and a late message (rule 2).
"""

from __future__ import annotations

import functools
import json
import time
from typing import TYPE_CHECKING, Any

from msglab.grading import rules
from msglab.grading.nemesis import Crash, rng
from msglab.grading.rules import plural
from msglab.grading.scaffold import HeldSpawns, Phases, Topology, Trace, gone, held
from msglab.grading.verdict import Check

if TYPE_CHECKING:  # learner processes import this module too: they need none of the grader's side
    from msglab.grading.harness import Run

TOPOLOGY = Topology(stream="ECHO", wildcard="echo.>", durable="echoer", subject="echo.in", ack_wait=0.4)
STREAM, DURABLE = TOPOLOGY.stream, TOPOLOGY.durable  # the contract: what the learner's permissions protect
FRESH, DEADLINE = 3, 3.0  # messages per crash incarnation; seconds any phase may take
WHERE = {"before": "before the echo", "after": "right after the echo"}


async def role_echo_worker(env: Any, learner: Any) -> None:
    """One incarnation of the learner's worker: waits held until the grader releases it."""

    async def echo(message_id: str, text: str) -> None:
        await env.nc.flush()  # a real call is a round trip: what the worker buffered (an ack) leaves now
        env.world.call("echo", str(message_id), text=str(text)[:200])

    env.echo = echo
    held(env)
    await learner.echo_worker(env)


async def playground(env: Any) -> None:
    """For a notebook: the same stream and durable, and an echo that prints."""
    await TOPOLOGY.provision(env.js, env.names)

    async def echo(message_id: str, text: str) -> None:
        print(f"echo {message_id}: {text}")

    env.echo = echo


def _faults(seed: int, number: int) -> list[Crash]:
    order = ["before", "after"]
    rng(seed, "order").shuffle(order)
    if number >= len(order):
        return []
    call = rng(seed, f"call{number}").randint(1, FRESH)
    return [
        Crash(
            "echo",
            call,
            order[number],
            point=f"{WHERE[order[number]]} on its env.echo call #{call}",
            counted="env.echo call",
            hint="echo every message you take, one env.echo call per message",
        )
    ]


async def grade(run: Run) -> list[Check]:
    """Crash twice, drain, go idle, send one late message; judge what the broker and the echo log saw."""
    await TOPOLOGY.provision(run.js, run.names)
    watch = await TOPOLOGY.watch(run)
    workers = HeldSpawns(run, "echo_worker", functools.partial(_faults, run.seed), limit=6)
    phase, sent = Phases(run), {}  # sent: key -> (stream sequence, when published)
    workers.prepare(3)

    async def publish(key: str) -> None:
        body = json.dumps({"id": key, "text": key.upper()}).encode()
        sent[key] = (await TOPOLOGY.publish(run, body), time.time())

    try:
        async with phase("crashes"):
            for number in range(2):
                for n in range(FRESH):
                    await publish(f"m-{number * FRESH + n + 1}")
                child = await workers.release()
                assert child is not None
                await run.wait_for(functools.partial(gone, child), DEADLINE)
                await workers.stop(child)
        async with phase("drain"):
            current = await workers.release()
            assert current is not None
            await run.wait_for(lambda: TOPOLOGY.drained(run), DEADLINE)
            info, since = await TOPOLOGY.info(run), watch.acks[-1].ts if watch.acks else time.time()
            await run.wait_for(lambda: watch.refetched_after_idle(since) is not None or gone(current), 2 * DEADLINE)
        async with phase("late message"):
            late, late_at = "m-late", time.time()
            await publish(late)
            await run.wait_for(lambda: bool(_echoes(run, late)) or gone(current), DEADLINE)
    finally:
        await workers.cancel()
    await workers.settle()
    trace = functools.partial(_trace, run, watch, sent)
    proof = rules.IdleProof(late, late_at, since, rules.drained(info), watch.refetched_after_idle(since), 6, 3)
    words = rules.IdleWords("the running worker survives an empty queue and echoes a late message", "echoed")
    return [
        _lost_check(run, sent, trace),
        _duplicate_check(run, sent, watch, workers.ended, trace),
        rules.drained_check(info, TOPOLOGY.durable, TOPOLOGY.ack_wait, hint="ack every message once it is echoed"),
        rules.survives_idle(run.at, proof, current, [e.pid for e in _echoes(run, late)], trace(late), words),
    ]


def _echoes(run: Run, key: str) -> list[Any]:
    return [e for e in run.log.events("effect", "echo") if e.key == key]


def _trace(run: Run, watch: Any, sent: dict[str, tuple[int, float]], key: str) -> list[str]:
    seq, published = sent[key]
    steps = Trace(run).add(published, "published")
    for event in run.log.events():
        if event.key == key and event.kind == "effect":
            steps.add(event.ts, f"worker {event.pid} called env.echo")
        elif event.key == key and event.kind == "crash":
            steps.add(event.ts, f"worker {event.pid} SIGKILLed by the grader {WHERE[event.detail['when']]}")
    for ack in watch.of(seq):
        steps.add(ack.ts, f"broker got {rules.an(ack.kind)} for delivery #{ack.delivered}")
    return steps.lines()


def _lost_check(run: Run, sent: dict[str, tuple[int, float]], trace: Any) -> Check:
    title = "every message is echoed, whatever crashed (none lost)"
    lost = [k for k in sent if k != "m-late" and not _echoes(run, k)]  # the late one is rule 2's
    if not lost:
        return Check("every_message_echoed", title, True)
    return Check(
        "every_message_echoed",
        title,
        False,
        f"{plural(len(lost), 'message')} never echoed: {', '.join(lost)}.",
        trace=[*trace(lost[0]), "never echoed"],
        hint="ack a message only once it is echoed",
    )


def _duplicate_check(
    run: Run, sent: dict[str, tuple[int, float]], watch: Any, ended: dict[int, float], trace: Any
) -> Check:
    title = "a message is echoed again only where a worker that echoed it died before the broker had its ack"
    for key, (seq, _) in sent.items():
        echoes = _echoes(run, key)
        allowance = rules.allowance(ended, echoes, watch, [seq])
        if len(echoes) > allowance.allowed:
            message = f"{key} was echoed {len(echoes)} times, allowed {allowance.allowed} (rule 6)."
            return Check(
                "duplicates_only_after_crash",
                title,
                False,
                message,
                trace=trace(key),
                hint="ack each message, once echoed, within ack_wait",
            )
    return Check("duplicates_only_after_crash", title, True)
