"""Lab 01 grader: an order service that announces orders as events, and one honest request-reply call.

Workload (seeded): place 4 orders with the email worker up; the worker is SIGKILLed while it
sends one of those emails (before the email goes out); place 5 more orders while it is down;
then bring a fresh worker up. Meanwhile ask the inventory service for stock three times: while
it answers, while nobody listens, and while it is silent.

Invariants judged on the effect store and the broker:
  orders are accepted while email is up, and while it is down (each within ACCEPT_BOUND);
  every accepted order is emailed once the worker is back, none twice; every order event is
  acked on the durable (nothing stuck); check_stock returns the answer when there is one and
  raises InventoryUnavailable quickly when there is none.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from msglab.broker import settle_subscriptions
from msglab.grading.harness import Reply, Run
from msglab.grading.labkit import LabEnv, provision
from msglab.grading.nemesis import Crash, rng
from msglab.grading.verdict import Check

STREAM = "ORDERS"
SUBJECT = "orders.placed"
DURABLE = "email"
INVENTORY = "inventory.check"
ACK_WAIT = 0.5  # seconds; production uses 30 s, a lab cannot wait that long
REQUEST_TIMEOUT = 0.5  # the timeout check_stock must use (env.request_timeout)
ACCEPT_BOUND = 1.0  # an order must be accepted within this, email up or down
ORDERS_UP, ORDERS_DOWN = 4, 5
CALL_DEADLINE = 3.0  # after this the grader declares a call hung and kills the process
STOCK_DEADLINE = REQUEST_TIMEOUT + 1.5  # the same, for check_stock
CATCH_UP = 6.0  # how long the restarted worker has to email everything
PARAMS = {"request_timeout": REQUEST_TIMEOUT}  # what env carries besides connections and names


# --- what runs inside the learner's processes ------------------------------------------------


def _add_effects(env: Any) -> None:
    """Give env the lab's side effects, each a crash point for the nemesis."""

    def send_email(order_id: str) -> None:
        env.world.call("send_email", str(order_id))

    def save_order(order: dict[str, Any]) -> None:
        env.world.call("save_order", str(order["id"]))

    env.send_email = send_email
    env.save_order = save_order


def ops_orders(env: LabEnv, learner: Any) -> dict[str, Any]:
    """The order service: the grader calls place_order and check_stock one at a time."""
    _add_effects(env)

    async def place_order(order: dict[str, Any]) -> None:
        await learner.place_order(env, order)

    async def check_stock(sku: str) -> Any:
        unavailable = getattr(learner, "InventoryUnavailable", None)
        try:
            return {"available": await learner.check_stock(env, sku)}
        except Exception as exc:
            if unavailable is not None and isinstance(exc, unavailable):
                return {"unavailable": str(exc)}
            raise

    return {"place_order": place_order, "check_stock": check_stock}


async def role_email_worker(env: LabEnv, learner: Any) -> None:
    """The email worker: runs until the grader kills it."""
    _add_effects(env)
    await learner.email_worker(env)


async def playground(env: Any) -> None:
    """For the lab notebook: the same stream and durable, and effects that print."""
    await _setup(env.js, env.names)
    env.save_order = lambda order: print(f"saved order {order['id']}")
    env.send_email = lambda order_id: print(f"email sent for {order_id}")


# --- the grader ------------------------------------------------------------------------------


async def _setup(js: Any, names: Any) -> None:
    # The platform team's part: the stream and the durable exist before any service starts.
    await provision(js, names, stream=STREAM, wildcard="orders.>", durable=DURABLE, subject=SUBJECT, ack_wait=ACK_WAIT)


async def grade(run: Run) -> list[Check]:
    """Run the workload with its faults and judge the invariants."""
    t0 = time.time()

    def at(when: float | None = None) -> str:
        return f"+{(when or time.time()) - t0:.2f}s"

    crash_call = rng(run.seed, "crash").randint(2, ORDERS_UP)
    stock_rng = rng(run.seed, "stock")
    orders: list[dict[str, Any]] = [
        {"id": f"o-{i}", "item": f"book-{stock_rng.randint(1, 99)}", "qty": 1}
        for i in range(1, ORDERS_UP + ORDERS_DOWN + 1)
    ]
    params = PARAMS
    await _setup(run.js, run.names)
    service, worker = await asyncio.gather(
        run.spawn("orders", params=params),
        run.spawn("email_worker", faults=[Crash("send_email", crash_call, "before")], params=params),
    )
    trace: dict[str, list[str]] = {o["id"]: [] for o in orders}
    replies: dict[str, tuple[str, Reply]] = {}

    # Phase 1: the worker runs, and crashes while sending email number `crash_call`. An order
    # whose call started after the crash counts as placed while email was down.
    started: dict[str, float] = {}
    for order in orders[:ORDERS_UP]:
        started[order["id"]] = time.time()
        reply = await service.call("place_order", CALL_DEADLINE, order=order)
        replies[order["id"]] = ("up", reply)
        trace[order["id"]].append(f"{at(started[order['id']])} placed: {reply.describe()}")
        if not reply.ok:
            break  # one refused order decides this phase; the learner should not wait for more
    crashed = await worker.wait_exit(CALL_DEADLINE)
    if not crashed:
        await worker.kill()
    crash_rows = run.log.events("crash", "send_email")
    for oid, when in started.items():
        if crash_rows and when > crash_rows[0].ts:
            replies[oid] = ("down", replies[oid][1])
    crash_key = crash_rows[0].key if crash_rows else None
    if crash_key:
        trace[crash_key].append(
            f"{at(crash_rows[0].ts)} worker {worker.pid} crashed while sending its email (before it went out)"
        )
    down_note = (
        f"email worker {worker.pid} crashed (injected, while sending email #{crash_call})"
        if crash_rows
        else f"email worker {worker.pid} never reached email #{crash_call}; the grader killed it"
    )

    # Phase 2: the email worker is down.
    for order in orders[ORDERS_UP:]:
        placed_at = at()
        reply = await service.call("place_order", CALL_DEADLINE, order=order)
        replies[order["id"]] = ("down", reply)
        trace[order["id"]].append(f"{placed_at} placed while the email worker was down: {reply.describe()}")
        if not reply.ok or reply.elapsed > ACCEPT_BOUND:
            break

    # Phase 3: a fresh worker comes back and catches up while the request-reply checks run.
    worker2 = await run.spawn("email_worker", params=params)
    for order in orders:
        trace[order["id"]].append(f"{at()} worker {worker2.pid} started")
    stock_checks = await _check_request_reply(run, service, stock_rng)

    accepted = [oid for oid, (_, reply) in replies.items() if reply.ok]

    def emails() -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in run.log.events("effect", "send_email"):
            counts[event.key or ""] = counts.get(event.key or "", 0) + 1
        return counts

    async def settled() -> bool:
        if any(n > 1 for n in emails().values()):
            return True  # a duplicate already decides the verdict: no need to wait longer
        # Everything delivered and acked: nothing more can arrive, whether all was emailed or not.
        info = await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(DURABLE))
        return info.num_ack_pending == 0 and info.num_pending == 0

    await run.wait_for(settled, CATCH_UP)
    sent = emails()
    info = await run.js.consumer_info(run.names.stream(STREAM), run.names.durable(DURABLE))
    for event in run.log.events("effect", "send_email"):
        trace.setdefault(event.key or "", []).append(f"{at(event.ts)} emailed by worker {event.pid}")

    checks = [
        _accepted_check(replies, "up", trace),
        _accepted_check(replies, "down", trace, down_note),
        _lost_check(accepted, sent, trace, worker2, info),
        _duplicate_check(sent, trace),
        _acked_check(info, len(accepted)),
    ]
    return checks + stock_checks


async def _check_request_reply(run: Run, service: Any, stock_rng: Any) -> list[Check]:
    sku = f"sku-{stock_rng.randint(100, 999)}"
    stock = stock_rng.randint(1, 500)
    subject = run.names.subject(INVENTORY)

    async def answer(msg: Any) -> None:
        await msg.respond(json.dumps({"sku": json.loads(msg.data)["sku"], "available": stock}).encode())

    async def ignore(msg: Any) -> None:
        return None

    sub = await run.nc.subscribe(subject, cb=answer)
    await settle_subscriptions(run.nc)
    up = await service.call("check_stock", STOCK_DEADLINE, sku=sku)
    await sub.unsubscribe()
    await settle_subscriptions(run.nc)
    nobody = await service.call("check_stock", STOCK_DEADLINE, sku=sku)
    sub = await run.nc.subscribe(subject, cb=ignore)
    await settle_subscriptions(run.nc)
    silent = await service.call("check_stock", STOCK_DEADLINE, sku=sku)
    await sub.unsubscribe()

    got = up.value.get("available") if up.ok and isinstance(up.value, dict) else None
    answers = Check(
        "request_reply_answers",
        "check_stock returns the inventory service's answer",
        got == stock,
        ""
        if got == stock
        else f"the inventory service answered available={stock} for {sku}; check_stock {_stock_outcome(up)}",
        hint=f"send {{'sku': sku}} as JSON to env.subject('{INVENTORY}') with env.nc.request "
        "and return the reply's 'available'",
    )
    return [
        answers,
        _unavailable_check(
            "request_reply_no_responders",
            "check_stock fails fast with InventoryUnavailable when nobody listens",
            nobody,
            REQUEST_TIMEOUT + 0.7,
            "nobody was subscribed to the inventory subject",
            "catch nats.errors.NoRespondersError (the server says at once that nobody listens) "
            "and raise InventoryUnavailable",
        ),
        _unavailable_check(
            "request_reply_timeout",
            "check_stock gives up with InventoryUnavailable after env.request_timeout when the service is silent",
            silent,
            REQUEST_TIMEOUT + 0.7,
            "the inventory service received the request and never answered",
            "pass timeout=env.request_timeout to env.nc.request and turn the timeout error into InventoryUnavailable",
        ),
    ]


def _stock_outcome(reply: Reply) -> str:
    if reply.ok and isinstance(reply.value, dict) and "unavailable" in reply.value:
        return f"raised InventoryUnavailable({reply.value['unavailable']}) after {reply.elapsed:.3f} s"
    if reply.ok and isinstance(reply.value, dict):
        return f"returned {reply.value.get('available')!r} after {reply.elapsed:.3f} s"
    return reply.describe()


def _unavailable_check(name: str, title: str, reply: Reply, bound: float, situation: str, hint: str) -> Check:
    raised = reply.ok and isinstance(reply.value, dict) and "unavailable" in reply.value
    fast = reply.elapsed <= bound
    passed = bool(raised and fast)
    message = ""
    if not passed:
        why = "" if raised else "; it must raise InventoryUnavailable (defined in your file)"
        slow = "" if fast else f"; the caller waited more than {bound:.1f} s"
        message = f"{situation}: check_stock {_stock_outcome(reply)}{why}{slow}"
    return Check(name, title, passed, message, hint=hint if not passed else "")


def _accepted_check(
    replies: dict[str, tuple[str, Reply]], phase: str, trace: dict[str, list[str]], note: str = ""
) -> Check:
    placed = [(oid, r) for oid, (p, r) in replies.items() if p == phase]
    refused = [(oid, r) for oid, r in placed if not r.ok or r.elapsed > ACCEPT_BOUND]
    if phase == "up":
        title = "orders are accepted while the email worker runs"
        hint = "place_order should store the order, publish its event to JetStream and return"
    else:
        title = f"orders are accepted while the email worker is down (each within {ACCEPT_BOUND:.0f} s)"
        hint = (
            "place_order must not wait for the email service: publish the order as an event with "
            "env.js.publish and return once the stream has stored it; the worker will catch up"
        )
    if not refused:
        return Check(f"accepts_with_email_{phase}", title, True)
    oid, reply = refused[0]
    when = "while the email worker was down" if phase == "down" else "while the email worker ran"
    message = (
        f"{len(refused)} of {len(placed)} orders placed {when} were not accepted in time: {oid} {reply.describe()}."
    )
    if phase == "down":
        message += (
            f"\nThe {note}. An order service that waits for email is only up when email is up:"
            " that is temporal coupling."
        )
    return Check(f"accepts_with_email_{phase}", title, False, message, trace=trace.get(oid, []), hint=hint)


def _lost_check(
    accepted: list[str], sent: dict[str, int], trace: dict[str, list[str]], worker: Any, info: Any
) -> Check:
    title = "every accepted order is emailed once the worker is back (none lost)"
    lost = [oid for oid in accepted if not sent.get(oid)]
    if not lost:
        return Check("no_lost_emails", title, True)
    oid = lost[0]
    message = f"{len(lost)} of {len(accepted)} accepted orders were never emailed: {', '.join(lost)}."
    if info.num_pending == 0 and info.num_ack_pending == 0:
        message += (
            f"\nThe broker holds nothing more for them: every event on the durable was delivered and acked "
            f"(ack floor at stream seq {info.ack_floor.stream_seq}), and an acked message never comes back."
        )
    else:
        message += f"\nStill not emailed {CATCH_UP:.0f} s after the worker came back."
    if worker.died:
        died = worker.died
        message += f"\nYour email_worker raised {died.get('error')}({died.get('message')}) at {died.get('where')}."
    elif not worker.alive:
        message += "\nThe restarted worker exited on its own: email_worker must keep consuming."
    return Check(
        "no_lost_emails",
        title,
        False,
        message,
        trace=[
            *trace.get(oid, []),
            f"end: durable '{DURABLE}' delivered {info.delivered.stream_seq} events "
            f"({info.num_redelivered} redelivered), {info.num_ack_pending} unacked",
            "never emailed",
        ],
        hint="consume from the durable env.durable('email') and ack only after env.send_email returned: "
        "then a crash before the ack means redelivery, not loss",
    )


def _duplicate_check(sent: dict[str, int], trace: dict[str, list[str]]) -> Check:
    title = "no order is emailed twice"
    twice = {oid: n for oid, n in sent.items() if n > 1}
    if not twice:
        return Check("no_duplicate_emails", title, True)
    oid = next(iter(twice))
    return Check(
        "no_duplicate_emails",
        title,
        False,
        f"{len(twice)} orders were emailed more than once: {oid} {twice[oid]} times. "
        "No crash fell between an email and its ack, so each order should be emailed exactly once.",
        trace=trace.get(oid, []),
        hint="ack every message after its work (msg.ack_sync()), on the durable env.durable('email'): an un-acked "
        "message comes back after ack_wait, and a consumer of your own re-reads the stream from the start",
    )


def _acked_check(info: Any, accepted: int) -> Check:
    title = "every order event is acked on the durable 'email' (nothing stuck)"
    pending, unacked = info.num_pending, info.num_ack_pending
    if pending == 0 and unacked == 0:
        return Check("all_acked", title, True)
    return Check(
        "all_acked",
        title,
        False,
        f"the durable 'email' still has {pending} undelivered and {unacked} delivered-but-unacked messages "
        f"({info.num_redelivered} redelivered) after the run.",
        hint="bind your worker to env.durable('email') on env.stream('ORDERS') "
        "and ack each message once its email is sent",
    )
