"""Module 07's shop services, each a process of its own on the course's server: payments, email, the status page,
and the course's relay (msglab.world.relay) on a shop's database: `start("relay", url, db_path=...)`.

    pay = start("payments", url, stream="ORDERS", durable="payments", gateway="gateway.charge",
                status="orders.status", dlq="orders.payments.dlq", key="seq")
    mail = start("email", url, stream="STATUS", durable="email", provider="provider.send", dlq="orders.email.dlq")
    page = start("status", url, subject="orders.status.>", stream="STATUS")
    page.url, page.orders()                      # the page's address; its GET /orders: {"o-001": "confirmed", ...}
    pay.pid, pay.alive, pay.kill(), pay.stop()   # kill(): SIGKILL, now; stop(): SIGTERM, then SIGKILL

Each service connects to `url` with the options given to `start` (sent on its stdin: no URL, hence no
credentials, on a command line any user can read) and says `ready` once it serves; it keeps no store,
fetches one message at a time and rides out a server restart.

payments: pulls order events (JSON {"id", "customer", "cents"}) from `durable` on `stream`. Per delivery:
status `pending`, then a charge at the course's gateway (msglab.world.gateway) with an idempotency key,
`key="order"` (the order id: charged once per order) or `key="seq"` (the event's stream sequence: once per
stored event; a redelivery is not charged again, an event stored twice is), then status `confirmed`, then
ack_sync. An order over `card_limit` cents (CARD_LIMIT, lesson 07's rule), or one the gateway refuses for
good (status 400), is not charged: its event goes to `dlq` with a `Dlq-Reason` and the status is `failed`.
A gateway that does not answer, or a key still in use (409), is naked: the event comes back. Statuses are
JSON {"id", "status", "customer"} on `<status>.<order id>`, published to JetStream (a stream must store
them: email reads them there), each with Nats-Msg-Id `status-<order or seq>-<status>`. Every status and
dead letter carries the event's Correlation-Id. `hold_after=k` with `announce=<subject>`: after charging
its k-th delivery (or, that one not charged, the first it charges after it) the process publishes
{"pid", "delivery", "seq", "order", "num_delivered"} on `announce` (core NATS) and waits, never acking:
a grader or a lesson SIGKILLs it there.

email: pulls status events from `durable` on `stream`; for a final one (confirmed, failed) it sends a
receipt through module 04's email provider (msglab.world.email_provider; `templates` per status, to
`<customer>@<domain>`, idempotency key `receipt-<order id>`, the event's Correlation-Id in the request's
headers, kept by the provider with the email; TEMPLATES' `payment_failed` is not one the
provider knows at start: deploy it with the provider's `template` control), then acks; `pending` is acked
unsent. Module
04's rule: a 5xx, a 429 or a dropped connection is retried with a nak whose delay grows (`backoff`), a
deliveries' budget of `max_deliver` (the durable's own); another error, or the budget spent, sends the
status event to `dlq` (Nats-Msg-Id `dlq-<stream seq>`, Correlation-Id carried, `Dlq-Reason`), then terms it.

status: msglab.world.status_page.StatusPage on `subject` (core NATS), read back from `stream`'s start at
start and after each reconnect (a server restart loses core messages), so `/orders` ends right.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import urllib.request
from typing import Any

from msglab.world.outbox import CORRELATION_ID

CARD_LIMIT = 15_000  # cents: payments refuses a larger order for good (lesson 07's rule)
SERVICES = ("payments", "email", "status", "relay")
TEMPLATES = {"confirmed": "order_confirmation", "failed": "payment_failed"}
BACKOFF = (0.1, 0.2, 0.4, 0.8)  # seconds before retry 1, 2, 3, 4 (production: 1, 10, 100, 1000 s)
MAX_DELIVER = 5
FETCH_TIMEOUT = 0.3  # seconds a fetch waits (scaled down: production long-polls 5-30 s)
RETRY = 0.1  # seconds before a failed fetch or publish is tried again (a pace, not a wait for a condition)
# A loaded machine (load average 12 on 2 cores) took over 10 s to start a service: generous, within a run's 45 s.
READY_TIMEOUT = 30.0
CONNECT_TRIES = 100  # a first connection is tried this many times, RETRY apart (a server restart takes ~1 s)


class Service:
    """A running service process: its pid, whether it lives, kill() (SIGKILL) and stop() (SIGTERM)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], ready: dict[str, Any]) -> None:
        self.name, self.proc, self.ready = name, proc, ready

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def url(self) -> str:
        """The status page's address ('' for the other services)."""
        return str(self.ready.get("url", ""))

    def orders(self, timeout: float = 5.0) -> dict[str, str]:
        """The status page's GET /orders: what it shows for each order now."""
        with urllib.request.urlopen(self.url + "orders", timeout=timeout) as reply:
            return {str(k): str(v) for k, v in json.loads(reply.read()).items()}

    def kill(self) -> None:
        """SIGKILL the process, now (nothing it holds is acked), and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close()

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.pid} {'running' if self.alive else 'stopped'}>"


def start(service: str, url: str, *, ready_timeout: float = READY_TIMEOUT, **options: Any) -> Service:
    """Start one service (`payments`, `email` or `status`) as a process of its own; return once it serves."""
    from msglab.broker.server import die_with_parent

    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r} (one of {', '.join(SERVICES)})")
    proc = subprocess.Popen(
        [sys.executable, "-m", "msglab.world.shop_services", service], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"url": url, **options}).encode() + b"\n")
    proc.stdin.close()
    readable, _, _ = select.select([proc.stdout], [], [], ready_timeout)
    line = proc.stdout.readline() if readable else b""
    try:
        ready = json.loads(line)
    except ValueError:
        ready = {}
    if ready.get("event") != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the {service} service did not start (it said {line!r})")
    return Service(service, proc, ready)


# --- the services, inside their processes ------------------------------------------------------------


def _carried(msg: Any, **more: str) -> dict[str, str]:
    """Headers for the next hop: `more` plus the message's Correlation-Id, if it carries one."""
    from msglab.world.correlation import carry

    if not (msg.headers or {}).get(CORRELATION_ID):
        return dict(more)  # nothing to carry: the next hop shows that, rather than an id made up here
    return carry(msg, **more)


async def _publish(js: Any, subject: str, body: bytes, headers: dict[str, str], tries: int = 20) -> None:
    """Publish to JetStream until a stream stored it (or raise after `tries`): a server restarting refuses a while."""
    for attempt in range(tries):
        try:
            await js.publish(subject, body, headers=headers)
            return
        except Exception:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(RETRY)


async def _pull(js: Any, stream: str, durable: str, handle: Any) -> None:
    """Fetch from the durable for ever, handing each message to `handle` (an error in it: the message comes back)."""
    sub = None
    while True:
        try:
            if sub is None:
                sub = await js.pull_subscribe_bind(durable, stream=stream)
            msgs = await sub.fetch(1, timeout=FETCH_TIMEOUT)  # one at a time: none waits out its ack_wait unhandled
        except TimeoutError:  # nothing to do yet: ask again
            continue
        except Exception:  # the server restarting: ask again shortly
            await asyncio.sleep(RETRY)
            continue
        for msg in msgs:
            try:
                await handle(msg)
            except Exception:  # unsettled: redelivered after ack_wait
                continue


async def payments(
    nc: Any,
    js: Any,
    *,
    stream: str,
    durable: str,
    gateway: str,
    status: str,
    dlq: str,
    key: str = "order",
    card_limit: int = CARD_LIMIT,
    hold_after: int = 0,
    announce: str = "",
) -> None:
    from msglab.world.gateway import GatewayError, IdempotencyKeyInUse, charge

    delivered = 0

    async def tell(order_id: str, ident: str, state: str, msg: Any, customer: str) -> None:
        body = json.dumps({"id": order_id, "status": state, "customer": customer}).encode()
        headers = _carried(msg, **{"Nats-Msg-Id": f"status-{ident}-{state}"})
        await _publish(js, f"{status}.{order_id}", body, headers)

    async def pay(msg: Any) -> None:
        nonlocal delivered
        delivered += 1
        seq = int(msg.metadata.sequence.stream)
        try:
            order = json.loads(msg.data)
            order_id, customer, cents = str(order["id"]), str(order.get("customer", "")), int(order["cents"])
        except (ValueError, KeyError, TypeError) as exc:  # not an order: never chargeable
            await _publish(js, dlq, msg.data, _carried(msg, **{"Dlq-Reason": f"not an order: {exc!r}"[:200]}))
            await msg.term()
            return
        ident = order_id if key == "order" else str(seq)
        await tell(order_id, ident, "pending", msg, customer)
        reason = ""
        if cents > card_limit:
            reason = f"over the card limit ({cents} > {card_limit} cents)"
        else:
            try:
                await charge(
                    nc, gateway, customer, cents, reference=order_id,
                    idempotency_key=order_id if key == "order" else f"orders-{seq}",
                )  # fmt: skip
            except IdempotencyKeyInUse:
                await msg.nak(delay=RETRY)  # the first request is still in flight: its charge will answer ours
                return
            except GatewayError as exc:  # refused for good: the same request fails again
                reason = f"the gateway refused the charge: {exc}"[:200]
            except Exception:  # no answer (a timeout, a server restarting): it may come, so keep the event
                await msg.nak(delay=RETRY)
                return
            if hold_after and delivered >= hold_after and announce:  # k-th delivery, or the first charged after
                said = {"pid": os.getpid(), "delivery": delivered, "seq": seq, "order": order_id}
                said["num_delivered"] = int(msg.metadata.num_delivered)
                await nc.publish(announce, json.dumps(said).encode())
                await nc.flush()
                await asyncio.Event().wait()  # charged, never acked: killed here
        if reason:
            headers = _carried(msg, **{"Dlq-Reason": reason, "Nats-Msg-Id": f"dlq-{ident}"})
            await _publish(js, dlq, msg.data, headers)
        await tell(order_id, ident, "failed" if reason else "confirmed", msg, customer)
        await msg.ack_sync()

    await _pull(js, stream, durable, pay)


async def email(
    nc: Any,
    js: Any,
    *,
    stream: str,
    durable: str,
    provider: str,
    dlq: str,
    templates: dict[str, str] | None = None,
    domain: str = "example.com",
    backoff: list[float] | None = None,
    max_deliver: int = MAX_DELIVER,
    send_timeout: float = 2.0,
) -> None:
    from msglab.world import email_provider as ep

    chosen = {**TEMPLATES, **(templates or {})}
    delays = list(backoff or BACKOFF)

    async def receipt(msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            order_id, state = str(body["id"]), str(body["status"])
        except (ValueError, KeyError, TypeError) as exc:
            return await dead_letter(msg, f"not a status event: {exc!r}"[:200])
        if state not in chosen:  # pending: no receipt yet
            return await msg.ack_sync()
        email = {"order_id": order_id, "to": f"{body.get('customer') or order_id}@{domain}", "template": chosen[state]}
        delivery = int(msg.metadata.num_delivered)
        try:
            await ep.send(nc, provider, email, idempotency_key=f"receipt-{order_id}",
                          correlation_id=(msg.headers or {}).get(CORRELATION_ID), timeout=send_timeout)  # fmt: skip
        except Exception as error:
            # Module 04's rule, judged from the error alone: a dropped connection, no answer, a 5xx or a 429
            # pass with time; any other answer says the request itself is wrong.
            status = error.status if isinstance(error, ep.EmailApiError) else 0  # else: no answer, or a reset
            if (status == 0 or status == 429 or status >= 500) and delivery < max_deliver:
                return await msg.nak(delay=delays[min(delivery, len(delays)) - 1])
            return await dead_letter(msg, f"{type(error).__name__}: {error}"[:200])
        await msg.ack_sync()

    async def dead_letter(msg: Any, reason: str) -> None:
        seq = int(msg.metadata.sequence.stream)
        headers = _carried(msg, **{"Dlq-Reason": reason, "Nats-Msg-Id": f"dlq-{seq}"})
        headers["Dlq-Deliveries"] = str(msg.metadata.num_delivered)
        await _publish(js, dlq, msg.data, headers)  # raises if never stored: the event stays unsettled
        await msg.term()

    await _pull(js, stream, durable, receipt)


async def status(
    nc: Any,
    js: Any,
    *,
    subject: str,
    stream: str = "",
    host: str = "127.0.0.1",
    port: int = 0,
    reconnected: list[Any] | None = None,
) -> str:
    """Start the page (its URL returned); it stays up while the process lives. `reconnected`: the connection's
    callbacks after a reconnect, where the page's catch-up joins."""
    from msglab.world.status_page import StatusPage

    page = await StatusPage.start(nc, subject=subject, host=host, port=port)
    if stream:
        lock = asyncio.Lock()

        async def catch_up() -> None:
            """Show every status the stream stored, oldest first (what a core subscription may have missed)."""
            from nats.js.errors import NotFoundError

            async with lock:
                seq = 1
                while True:
                    try:
                        msg = await js.get_msg(stream, seq, subject=subject, next=True)
                    except NotFoundError:
                        return
                    except Exception:  # the server not back yet: try again shortly
                        await asyncio.sleep(RETRY)
                        continue
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        body = json.loads(msg.data)
                        page.apply(str(body["id"]), str(body["status"]), (msg.headers or {}).get(CORRELATION_ID, ""))
                    seq = int(msg.seq or seq) + 1

        await catch_up()
        if reconnected is not None:
            reconnected.append(catch_up)
    return page.url


async def relay(nc: Any, js: Any, *, db_path: str, poll: float = 0.02) -> None:
    """The course's relay (msglab.world.relay) on the shop's database, for ever."""
    from msglab.world.outbox import open_store
    from msglab.world.relay import Relay

    await Relay(open_store(db_path), js, poll=poll).run()


async def _serve(service: str, options: dict[str, Any]) -> None:
    import nats

    from msglab.broker import tls_options

    url = options.pop("url")

    async def quiet(_: Exception) -> None:
        """A server that restarts is reconnected to: nothing to print."""

    reconnected: list[Any] = []
    running: set[asyncio.Task[Any]] = set()

    async def on_reconnect() -> None:
        for callback in reconnected:  # as tasks: a callback that waits on the server must not hold the client
            task = asyncio.ensure_future(callback())
            running.add(task)
            task.add_done_callback(running.discard)

    for attempt in range(CONNECT_TRIES):  # a server restarting as the service starts is waited for, not fatal
        try:
            nc = await nats.connect(
                url, name=f"msglab-{service}", max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=quiet,
                reconnected_cb=on_reconnect, **tls_options(url),
            )  # fmt: skip
            break
        except Exception:
            if attempt == CONNECT_TRIES - 1:
                raise
            await asyncio.sleep(RETRY)
    js = nc.jetstream()
    ready: dict[str, Any] = {"event": "ready", "pid": os.getpid()}
    try:
        if service == "status":
            ready["url"] = await status(nc, js, **options, reconnected=reconnected)
            print(json.dumps(ready), flush=True)
            await asyncio.Event().wait()
        run: Any = {"payments": payments, "email": email, "relay": relay}[service]
        print(json.dumps(ready), flush=True)
        await run(nc, js, **options)
    finally:
        with contextlib.suppress(Exception):  # a connection already gone: nothing to print on the way out
            await nc.close()


async def _until_stopped(service: str, options: dict[str, Any]) -> None:
    """Serve until SIGTERM, which ends the service quietly (its connection closed, no traceback)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await _serve(service, options)


def main(argv: list[str] | None = None) -> None:
    """`python -m msglab.world.shop_services <service>`, its options as one JSON line on stdin."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in SERVICES:
        sys.exit(f"usage: python -m msglab.world.shop_services {{{','.join(SERVICES)}}} < options.json")
    options = json.loads(sys.stdin.readline())
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_until_stopped(args[0], options))


if __name__ == "__main__":
    main()
