"""Lesson 04's plumbing on a real server: the email provider answers by status, and the bench's runs
count what the lesson says they count. Counts and states only, no timing."""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

from nats.js.errors import NotFoundError

from msglab.broker import connect
from msglab.broker.server import EmbeddedServer
from msglab.demos import poison_messages as demo
from msglab.world import email_provider as ep

DELAYS = [0.05, 0.1, 0.2, 0.4]


def transient(error: Exception) -> bool:
    status = getattr(error, "status", None)
    return isinstance(error, ConnectionError) or status == 429 or (status or 0) >= 500


async def nak_at_once(env: Any, msg: Any) -> None:
    try:
        await env.send_email(json.loads(msg.data))
    except Exception:
        await msg.nak()
        return
    await msg.ack_sync()


async def nak_with_backoff(env: Any, msg: Any) -> None:
    n = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception:
        await msg.nak(delay=DELAYS[min(n, len(DELAYS)) - 1])
        return
    await msg.ack_sync()


async def dead_letter(env: Any, msg: Any, error: Exception) -> None:
    headers = dict(msg.headers or {})
    headers["Dlq-Reason"] = f"{type(error).__name__}: {error}"
    headers["Dlq-Deliveries"] = str(msg.metadata.num_delivered)
    headers["Dlq-Stream-Seq"] = str(msg.metadata.sequence.stream)
    if ID_DEAD_LETTERS:
        headers["Nats-Msg-Id"] = f"dlq-{msg.metadata.sequence.stream}"
    await env.js.publish(env.dlq_subject, msg.data, headers=headers)


async def with_dlq(env: Any, msg: Any) -> None:
    n = msg.metadata.num_delivered
    try:
        await env.send_email(json.loads(msg.data))
    except Exception as error:
        if transient(error) and n < 5:
            await msg.nak(delay=DELAYS[n - 1])
            return
        await dead_letter(env, msg, error)
        await msg.term()
        return
    await msg.ack_sync()


async def redrive(env: Any, order_ids: list[str], remove: bool = True) -> None:
    seq = 1
    while True:
        try:
            entry = await env.js.get_msg(env.dlq_stream, seq, subject=env.dlq_subject, next=True)
        except NotFoundError:
            return
        seq = entry.seq + 1
        if entry.headers.get("Order-Id") in order_ids:
            headers = {k: v for k, v in entry.headers.items() if not k.startswith(("Dlq-", "Nats-"))}
            headers["Nats-Msg-Id"] = f"redrive-{entry.seq}"
            await env.js.publish(env.subject, entry.data, headers=headers)
            if remove:
                await env.js.delete_msg(env.dlq_stream, entry.seq)


ID_DEAD_LETTERS = False  # shipped to the worker as a constant; each test module run writes it in


def bench_run(server: EmbeddedServer, handler: Any, emails: list[str], **options: Any) -> demo.Result:
    async def go() -> demo.Result:
        nc = await connect(server.url)
        provider = ep.start(server.url, prefix=demo.PROVIDER_PREFIX)
        try:
            return await demo.Bench(nc, provider).run(handler, emails, **options)
        finally:
            provider.stop()
            await nc.close()

    return asyncio.run(go())


def test_provider_answers_like_an_email_api(server: EmbeddedServer) -> None:
    async def go() -> tuple[list[Any], list[ep.Request]]:
        nc = await connect(server.url)
        provider = ep.start(server.url, prefix="test04.provider")
        try:
            await provider.control(nc, "mailbox", address="nobody@example.com", exists=False)
            await provider.control(nc, "domain", name="fjord.example", reachable=False)
            await provider.control(nc, "script", address="flaky@example.com", answers=["reset", "429"])
            outcomes: list[Any] = []
            for to, template in [
                ("ana@example.com", "order_confirmation"),
                ("nobody@example.com", "order_confirmation"),
                ("ana@example.com", "order_shipped_v2"),
                ("lars@fjord.example", "order_confirmation"),
                ("flaky@example.com", "order_confirmation"),
                ("flaky@example.com", "order_confirmation"),
                ("flaky@example.com", "order_confirmation"),
            ]:
                try:
                    outcomes.append(
                        await ep.send(nc, provider.subject, {"order_id": "o-1", "to": to, "template": template})
                    )
                except ep.EmailApiError as exc:
                    outcomes.append(exc.status)
                except ConnectionResetError:
                    outcomes.append("reset")
            await provider.outage(nc, 30)
            try:
                await ep.send(
                    nc, provider.subject, {"order_id": "o-2", "to": "ana@example.com", "template": "order_shipped"}
                )
            except ep.EmailApiError as exc:
                outcomes.append(exc.status)
            return outcomes, provider.requests()
        finally:
            provider.stop()
            await nc.close()

    outcomes, requests = asyncio.run(go())
    assert outcomes[1:] == [422, 400, 502, "reset", 429, outcomes[6], 503]
    assert str(outcomes[0]).startswith("em_") and str(outcomes[6]).startswith("em_")
    assert [r.status for r in requests] == [200, 422, 400, 502, 0, 429, 200, 503]
    assert ep.EmailApiError("503 Service Unavailable: down").status == 503


def test_a_reset_after_the_send_leaves_the_email_sent_and_a_key_sends_it_once(server: EmbeddedServer) -> None:
    async def go() -> tuple[list[Any], list[ep.Sent], list[ep.Request]]:
        nc = await connect(server.url)
        provider = ep.start(server.url, prefix="test04.provider")
        email = {"order_id": "o-1046", "to": "rita@example.com", "template": "order_confirmation"}
        outcomes: list[Any] = []

        async def send(key: str | None) -> None:
            try:
                outcomes.append(await ep.send(nc, provider.subject, email, idempotency_key=key))
            except ConnectionResetError:
                outcomes.append("reset")

        try:
            for key in (None, "o-1046-confirmation"):
                await provider.control(nc, "script", address="Rita@example.com", answers=["reset_after_send"])
                await send(key)
                await send(key)
            await send("another key")
            return outcomes, provider.sent("o-1046"), provider.requests("o-1046")
        finally:
            provider.stop()
            await nc.close()

    outcomes, sent, requests = asyncio.run(go())
    assert [o if o == "reset" else "id" for o in outcomes] == ["reset", "id", "reset", "id", "id"]
    assert len(sent) == 4  # unkeyed: the reset's email and the retry's; keyed: one; another key: one more
    assert outcomes[3] == sent[2].message_id  # the keyed retry got the email its reset hid
    assert [r.status for r in requests] == [200] * 5
    assert [r.outcome for r in requests] == ["sent, then reset", "sent", "sent, then reset", "replayed", "sent"]


def test_hot_loop_delivers_the_poison_over_and_over(no_nats_url: None, server: EmbeddedServer) -> None:
    hot = bench_run(server, nak_at_once, ["o-1042 bounce", "o-2001 ok"], seconds=0.5)
    assert hot.deliveries("o-1042") > 5 and set(hot.answers("o-1042")) == {422}
    assert hot.sent["o-2001"] == 1 and hot.settles("o-1042")[0] == "nak"


async def classify_keyed(env: Any, msg: Any) -> None:
    n = msg.metadata.num_delivered
    email = json.loads(msg.data)
    try:
        await env.send_email(email, idempotency_key=f"{email['order_id']}-{email['template']}")
    except Exception as error:
        if transient(error) and n < 5:
            await msg.nak(delay=DELAYS[n - 1])
        else:
            await msg.term()
        return
    await msg.ack_sync()


def test_a_retry_after_a_reset_sends_twice_and_once_with_an_idempotency_key(
    no_nats_url: None, server: EmbeddedServer
) -> None:
    twice = bench_run(server, with_dlq, ["o-1046 reset_after_send", "o-2001 ok"], max_deliver=5)
    once = bench_run(server, classify_keyed, ["o-1046 reset_after_send", "o-2001 ok"], max_deliver=5)
    for run in (twice, once):
        assert run.answers("o-1046") == {0: 1, 200: 1} and run.deliveries("o-1046") == 2
        assert run.settles("o-1046") == ["nak 0.05", "ack"] and run.sent["o-2001"] == 1
    assert twice.sent["o-1046"] == 2 and once.sent["o-1046"] == 1
    assert [row[3] for row in twice.summary().rows] == [2, 1]


def test_dead_letters_once_with_an_id_and_twice_without_after_a_kill(no_nats_url: None, server: EmbeddedServer) -> None:
    global ID_DEAD_LETTERS
    twice = bench_run(server, with_dlq, ["o-1042 bounce"], max_deliver=5, kill="after_dead_letter")
    ID_DEAD_LETTERS = True
    try:
        once = bench_run(server, with_dlq, ["o-1042 bounce"], max_deliver=5, kill="after_dead_letter")
    finally:
        ID_DEAD_LETTERS = False
    assert twice.kills == 1 and twice.dlq_count("o-1042") == 2 and twice.duplicates == 0
    assert once.kills == 1 and once.dlq_count("o-1042") == 1 and once.duplicates == 1
    entry = once.dlq[0]
    assert entry.deliveries == "1" and entry.stream_seq == "1" and "422" in entry.reason
    assert entry.headers["Correlation-Id"] == "corr-o-1042"


def test_budget_drops_silently_and_redrive_sends_each_once(no_nats_url: None, server: EmbeddedServer) -> None:
    inbox = bench_run(
        server, with_dlq, ["o-1044 template", "o-1045 unreachable", "o-2001 ok"], max_deliver=5,
        fix=["o-1044", "o-1045"], redrive=partial(redrive, remove=False), redrive_runs=2,
    )  # fmt: skip
    assert [d.order for d in inbox.dlq] == ["o-1044", "o-1045"]
    assert inbox.dlq[1].deliveries == "5"  # the unreachable server: retried to the end of the budget
    assert inbox.sent == {"o-1044": 1, "o-1045": 1, "o-2001": 1}  # the rerun inside the window: dropped by id
    assert inbox.ended("o-1044") == "sent" and inbox.dlq_window == 120


def test_a_rerun_past_the_window_sends_again_unless_the_redrive_removed_its_entries(
    no_nats_url: None, server: EmbeddedServer
) -> None:
    later = {"redrive_runs": 2, "redrive_gap": 0.5, "window": 0.2}
    emails = ["o-1042 bounce", "o-1044 template"]
    id_only = bench_run(
        server, with_dlq, emails, max_deliver=5, fix=["o-1044"], redrive=partial(redrive, remove=False), **later
    )
    removed = bench_run(server, with_dlq, emails, max_deliver=5, fix=["o-1044"], redrive=redrive, **later)
    assert id_only.sent["o-1044"] == 2 and [d.order for d in id_only.dlq] == ["o-1042", "o-1044"]
    assert removed.sent["o-1044"] == 1 and [d.order for d in removed.dlq] == ["o-1042"]
    assert removed.sent["o-1042"] == 0 == id_only.sent["o-1042"]


def test_strict_order_stalls_behind_the_poison(no_nats_url: None, server: EmbeddedServer) -> None:
    line = ["o-1042 bounce", *demo.orders(5)]
    stuck = bench_run(server, nak_with_backoff, line, max_ack_pending=1, seconds=0.5)
    assert stuck.emails_behind_sent("o-1042") == 0 and stuck.deliveries("o-1042") >= 2
    assert stuck.finished() == {}  # nothing acked or termed: the queue age is the poison's, the whole run
    ages = [age for _, age in stuck.queue_ages()]
    assert ages == sorted(ages) and ages[-1] > 0
    moving = bench_run(server, with_dlq, line, max_ack_pending=1, max_deliver=5)
    assert moving.emails_behind_sent("o-1042") == 5 and moving.dlq_count("o-1042") == 1
    assert moving.first_behind("o-1042") is not None and set(moving.finished()) == {e.split()[0] for e in line}
    # Strict order: nothing behind the poison is delivered before its last delivery.
    behind = [t for email in demo.orders(5) for t in moving.times(email.split()[0])]
    assert len(behind) >= 5 and min(behind) > max(moving.times("o-1042"))


def test_server_facts_the_lesson_shows(server: EmbeddedServer) -> None:
    async def go() -> tuple[Any, ...]:
        nc = await connect(server.url)
        js = nc.jetstream()
        try:
            return (
                await demo.consumer_rules(js, DELAYS), await demo.advisories_by_kind(nc),
                await demo.durable_defaults(js), await demo.nak_keeps_its_slot(js, delay=0.3),
            )  # fmt: skip
        finally:
            await nc.close()

    rules, advisories, defaults, held = asyncio.run(go())
    assert [row[1] for row in rules.rows] == ["accepted", "accepted", "refused"]
    assert "ack_wait 0.05 s" in rules.rows[0][2] and "10116" in rules.rows[2][2]
    # A pull durable's advisory waits for a pull request; a push durable's does not.
    assert (advisories.pull_idle, advisories.pull_fetched, advisories.push) == (0, 1, 1)
    assert defaults["max_deliver"] == -1 and defaults["backoff"] is None
    # The naked order kept the only max_ack_pending slot: the next fetch is its redelivery, not the next order.
    assert (held.data, held.delivery) == ("o-1042", 2)


def test_nak_and_term_wait_in_the_client_buffer_and_a_kill_before_it_leaves_brings_it_back_after_ack_wait(
    server: EmbeddedServer,
) -> None:
    async def go() -> tuple[demo.BufferedSettles, demo.KilledAfterSettling]:
        return await demo.settles_in_the_buffer(server.url), await demo.settle_then_kill(server.url, 0.5, delay=2.0)

    buffered, killed = asyncio.run(go())
    nak, term = buffered["nak()"], buffered["term()"]
    assert nak.bytes_buffered > 0 and term.bytes_buffered > 0  # the call returned with its bytes still here
    # Asked before the worker's event loop ran again: o-1042 still held by the worker, offered to nobody.
    assert (nak.unacked_before, nak.offered_before, term.unacked_before, term.offered_before) == (1, 0, 1, 0)
    # After a flush: the nak offered it again at once (delivery 2), the term finished it.
    assert (nak.unacked_after, nak.offered_after, term.unacked_after, term.offered_after) == (1, 2, 0, 0)
    # SIGKILLed before the buffer left: the server still held it, and delivered it again (after ack_wait).
    for did in ("nak()", "nak(delay=2)", "term()"):
        assert (killed[did].exit_signal, killed[did].unacked, killed[did].deliveries) == (9, 1, 2)
    # A nak that arrived: still pending until its redelivery, which came (at once, or after the delay).
    for did in ("nak(), flush()", "nak(delay=2), flush()"):
        assert (killed[did].exit_signal, killed[did].unacked, killed[did].deliveries) == (9, 1, 2)
    # The lost nak(delay=2) came back when ack_wait (0.5 s) ran out, before the one whose delay reached the server.
    lost, arrived = killed["nak(delay=2)"].seconds, killed["nak(delay=2), flush()"].seconds
    assert lost is not None and arrived is not None and lost < arrived
    flushed = killed["term(), flush()"]
    assert (flushed.exit_signal, flushed.unacked, flushed.deliveries, flushed.seconds) == (9, 0, 1, None)
    assert killed.deliveries("term()") == 2 and "finished" in repr(killed) and "nothing" in repr(buffered)


def test_without_jitter_every_retry_returns_in_the_same_instant() -> None:
    table = demo.return_after_outage(clients=200, outage=10, delays=[1, 2, 4, 8, 16])
    busiest = {row[0]: row[1] for row in table.rows}
    assert busiest["backoff"] == 200 and busiest["Retry-After: 10 (once)"] == 200
    assert busiest["backoff with jitter"] < 50 and busiest["Retry-After: 10, plus jitter"] < 50


def test_the_handler_travels_with_the_helpers_and_constants_it_uses() -> None:
    folder, path = demo.write_module(with_dlq)
    try:
        with open(path) as module:
            text = module.read()
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    assert "async def with_dlq" in text and "async def dead_letter" in text and "def transient" in text
    assert "DELAYS = [0.05, 0.1, 0.2, 0.4]" in text and "ID_DEAD_LETTERS = False" in text
