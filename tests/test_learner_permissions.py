"""The learner user of a run's own server, and a slot user of a shared one, checked operation by
operation on a real nats-server: it may publish to its lab's stream, read it, fetch from and ack
the platform's durable and read its info, and make consumers of its own; it may not create or
update the platform's durable (by name, or by the unnamed legacy create whose config names it),
list consumers, speak for or listen to a course service, read the grader's inbox, or store more
than its account's bound."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from msglab.broker.server import EmbeddedServer
from msglab.broker.users import (
    LEARNER_INBOX,
    RUN_JETSTREAM,
    SLOT_JETSTREAM,
    RunUsers,
    SharedUsers,
    slot_grader_url,
    slot_prefix,
    slot_url,
)

LAB = types.SimpleNamespace(
    STREAM="ORDERS", STREAMS=("ORDERS", "ORDERS_DLQ"), DURABLE="fulfil", LEARNER_SUBJECTS=["orders.>"],
    LEARNER_REQUESTS=["inventory.reserve"], LEARNER_DENY_PUBLISH=["orders.audit"],
)  # fmt: skip
NS = 1_000_000_000


@pytest.fixture(params=["declared", "course-wide"])
def run_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, RunUsers]]:
    """A run's own server, its users made from a lab's declarations or (as today's harness) without them."""
    # course-wide: as today's harness makes them, from a grader's LEARNER_DENY_PUBLISH alone (lab 03's)
    users = RunUsers(grader=LAB) if request.param == "declared" else RunUsers(["gateway.>"])
    folder = tempfile.mkdtemp(prefix="msglab-perm-test-")
    config = os.path.join(folder, "server.conf")
    Path(config).write_text(users.config())
    with EmbeddedServer(config=config) as server:
        yield users.grader_url(server.url), users.learner_url(server.url), users
    os.unlink(config)
    os.rmdir(folder)


async def _attempt(coro: Any) -> str:
    """'ok', or what refused it (a permission violation shows as no answer: a timeout)."""
    try:
        result = await asyncio.wait_for(coro, 1.5)
    except Exception as exc:
        return f"refused {type(exc).__name__}: {exc}"
    data = getattr(result, "data", None)
    if data is not None and b'"error"' in data:
        return f"refused by the server: {data.decode()[:200]}"
    return "ok"


def _create_request(stream: str, **config: Any) -> bytes:
    base = {"filter_subject": "orders.placed", "ack_policy": "explicit", "ack_wait": 5 * NS}
    return json.dumps({"stream_name": stream, "config": {**base, **config}}).encode()


async def _operations(grader_url: str, learner_url: str, inbox: str, names: dict[str, str]) -> dict[str, str]:
    """Every operation a learner might try, and what the server said."""
    grader = await nats.connect(grader_url)
    stream, durable, dlq, subject = names["stream"], names["durable"], names["dlq"], names["subject"]
    js_g = grader.jetstream()
    await js_g.add_stream(name=stream, subjects=[names["wildcard"]])
    await js_g.add_stream(name=dlq, subjects=[names["dlq_subject"]])
    await js_g.add_consumer(
        stream, ConsumerConfig(durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT, ack_wait=5)
    )
    learner = await nats.connect(learner_url, inbox_prefix=inbox, allow_reconnect=False)
    js = learner.jetstream()
    seen: list[str] = []
    out: dict[str, str] = {}
    out["publish to the lab's stream"] = await _attempt(js.publish(subject, b"o-1"))
    out["stream info"] = await _attempt(js.stream_info(stream))
    out["get a message"] = await _attempt(js.get_msg(stream, 1))
    out["consumer info of the platform durable"] = await _attempt(js.consumer_info(stream, durable))

    async def fetch_and_ack() -> None:
        sub = await js.pull_subscribe_bind(durable, stream)
        [msg] = await sub.fetch(1, timeout=1)
        await msg.ack_sync()

    out["fetch from and ack on the platform durable"] = await _attempt(fetch_and_ack())
    out["bind by pull_subscribe(durable=...)"] = await _attempt(
        js.pull_subscribe(subject, durable=durable, stream=stream)
    )
    out["an ephemeral consumer of its own"] = await _attempt(js.pull_subscribe(subject, stream=stream))
    out["an unnamed consumer on the DLQ"] = await _attempt(
        js.add_consumer(dlq, ConsumerConfig(ack_policy=AckPolicy.NONE))
    )
    backoff = {"backoff": [NS, 2 * NS], "max_deliver": 5, "durable_name": durable, "name": durable}
    out["update the durable by name"] = await _attempt(
        learner.request(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.{subject}", _create_request(stream, **backoff))
    )
    out["update the durable by name, no filter"] = await _attempt(
        learner.request(f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", _create_request(stream, **backoff))
    )
    legacy = {"backoff": [NS, 2 * NS], "max_deliver": 5, "name": durable}
    out["update the durable by the unnamed create"] = await _attempt(
        learner.request(f"$JS.API.CONSUMER.CREATE.{stream}", _create_request(stream, **legacy))
    )
    out["list consumers"] = await _attempt(js.consumers_info(stream))
    out["delete the durable"] = await _attempt(js.delete_consumer(stream, durable))
    out["purge the stream"] = await _attempt(js.purge_stream(stream))

    async def overhear(msg: Any) -> None:
        seen.append(msg.subject)

    async def answer(msg: Any) -> None:
        await msg.respond(b"{}")

    services = [await grader.subscribe(names[name], cb=answer) for name in ("provider", "gateway")]
    await grader.flush()
    for what, target in (("speak for the email provider", names["provider"]), ("for the gateway", names["gateway"])):
        out[what] = await _attempt(learner.request(target, b"{}", timeout=1))
    await learner.subscribe("_INBOX.>", cb=overhear)
    await learner.subscribe(names["provider"], cb=overhear)
    await learner.flush()
    await grader.request(names["provider"], b'{"to": "a@b.example"}', timeout=1)
    for sub in services:
        await sub.unsubscribe()
    await learner.flush()
    out["read the grader's requests and answers"] = f"saw {seen}" if seen else "refused"
    info = await js_g.consumer_info(stream, durable)
    out["the durable's config after all that"] = f"backoff {info.config.backoff} max_deliver {info.config.max_deliver}"
    await learner.close()
    await grader.close()
    return out


ALLOWED = [
    "publish to the lab's stream",
    "stream info",
    "get a message",
    "consumer info of the platform durable",
    "fetch from and ack on the platform durable",
    "bind by pull_subscribe(durable=...)",
    "an ephemeral consumer of its own",
    "an unnamed consumer on the DLQ",
]
DENIED = [
    "update the durable by name",
    "update the durable by name, no filter",
    "update the durable by the unnamed create",
    "list consumers",
    "delete the durable",
    "purge the stream",
    "speak for the email provider",
    "for the gateway",
]


def _judge(out: dict[str, str]) -> None:
    for what in ALLOWED:
        assert out[what] == "ok", (what, out[what])
    for what in DENIED:
        assert out[what].startswith("refused"), (what, out[what])
    assert out["read the grader's requests and answers"] == "refused", out
    assert out["the durable's config after all that"] == "backoff None max_deliver -1", out


def test_the_learner_user_of_a_runs_own_server_gets_what_a_lab_needs_and_nothing_more(
    run_server: tuple[str, str, RunUsers],
) -> None:
    grader_url, learner_url, _users = run_server
    names = {"stream": "ORDERS", "durable": "fulfil", "dlq": "ORDERS_DLQ", "subject": "orders.placed",
             "wildcard": "orders.placed", "dlq_subject": "orders.dlq", "provider": "provider.send",
             "gateway": "gateway.charge"}  # fmt: skip
    out = asyncio.run(_operations(grader_url, learner_url, LEARNER_INBOX, names))
    _judge(out)


def test_a_runs_jetstream_storage_is_bounded_and_the_learner_is_told_so(
    run_server: tuple[str, str, RunUsers],
) -> None:
    grader_url, learner_url, _users = run_server

    async def hog() -> tuple[int, str]:
        grader = await nats.connect(grader_url)
        await grader.jetstream().add_stream(name="ORDERS", subjects=["orders.>"])
        learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX)
        js, stored, chunk = learner.jetstream(), 0, b"x" * (256 << 10)
        try:
            for _ in range(2000):  # 500 MB, far past the bound
                await js.publish("orders.placed", chunk)
                stored += len(chunk)
            return stored, "never refused"
        except Exception as exc:
            return stored, f"{type(exc).__name__}: {exc}"
        finally:
            await learner.close()
            await grader.close()

    stored, error = asyncio.run(hog())
    assert stored <= RUN_JETSTREAM["max_file"], (stored, error)
    assert "resource limits exceeded" in error or "insufficient resources" in error, error


def test_a_slot_user_is_at_least_as_strict(tmp_path: Path) -> None:
    users = SharedUsers()
    config = tmp_path / "shared.conf"
    config.write_text(users.config())
    with EmbeddedServer(config=str(config)) as server:
        admin = users.admin_url(server.url)
        prefix = slot_prefix(7)
        names = {"stream": f"{prefix.upper()}_ORDERS", "durable": f"{prefix}_fulfil",
                 "dlq": f"{prefix.upper()}_EMAILS_DLQ", "subject": f"{prefix}.orders.placed",
                 "wildcard": f"{prefix}.orders.placed", "dlq_subject": f"{prefix}.orders.email.dlq",
                 "provider": f"{prefix}.provider.send", "gateway": f"{prefix}.gateway.charge"}  # fmt: skip
        out = asyncio.run(_operations(slot_grader_url(admin, 7), slot_url(admin, 7), f"_INBOX_{prefix}", names))
    _judge(out)


def test_a_slots_jetstream_storage_is_bounded_and_the_slot_cannot_lift_the_bound(tmp_path: Path) -> None:
    users = SharedUsers()
    config = tmp_path / "shared.conf"
    config.write_text(users.config())

    async def hog(admin: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        grader = await nats.connect(slot_grader_url(admin, 7))
        await grader.jetstream().add_stream(name="S07_ORDERS", subjects=["s07.orders.>"])
        learner = await nats.connect(slot_url(admin, 7), inbox_prefix="_INBOX_s07", allow_reconnect=False)
        js, stored, chunk = learner.jetstream(), 0, b"x" * (256 << 10)
        try:
            for _ in range(1000):  # 250 MB, far past the bound
                await js.publish("s07.orders.placed", chunk)
                stored += len(chunk)
            out["hog"] = "never refused"
        except Exception as exc:
            out["hog"] = f"{type(exc).__name__}: {exc}"
        out["stored"] = stored
        # Lifting the bound: a stream of its own, or the grader's stream made bigger (the API is not its to call).
        lift = json.dumps({"name": "S07_ORDERS", "subjects": ["s07.orders.>"], "max_bytes": -1}).encode()
        out["update the stream"] = await _attempt(learner.request("$JS.API.STREAM.UPDATE.S07_ORDERS", lift))
        out["create a stream"] = await _attempt(js.add_stream(name="S07_MORE", subjects=["s07.more"]))
        info = await grader.jetstream().account_info()
        out["account"] = (info.limits.max_storage, info.storage)
        # Another slot stores as before; the course's own account does not even see slot 7's stream.
        other = await nats.connect(slot_grader_url(admin, 8))
        await other.jetstream().add_stream(name="S08_ORDERS", subjects=["s08.orders.>"])
        out["slot 8"] = await _attempt(other.jetstream().publish("s08.orders.placed", chunk))
        course = await nats.connect(admin)
        out["course sees slot 7"] = await _attempt(course.jetstream().stream_info("S07_ORDERS"))
        for nc in (learner, grader, other, course):
            await nc.close()
        return out

    with EmbeddedServer(config=str(config)) as server:
        out = asyncio.run(hog(users.admin_url(server.url)))
    assert out["stored"] <= SLOT_JETSTREAM["max_file"] and "err_code=10002" in out["hog"], out  # limits exceeded
    assert out["update the stream"].startswith("refused") and out["create a stream"].startswith("refused"), out
    assert out["account"][0] == SLOT_JETSTREAM["max_file"] and out["account"][1] <= SLOT_JETSTREAM["max_file"], out
    assert out["slot 8"] == "ok" and out["course sees slot 7"].startswith("refused NotFoundError"), out


def test_a_declared_lab_service_takes_the_learners_requests_but_the_learner_cannot_answer_for_it(
    tmp_path: Path,
) -> None:
    users = RunUsers(grader=LAB)
    config = tmp_path / "server.conf"
    config.write_text(users.config())

    async def scenario(grader_url: str, learner_url: str) -> tuple[str, list[str]]:
        grader = await nats.connect(grader_url)
        learner = await nats.connect(learner_url, inbox_prefix=LEARNER_INBOX)
        overheard: list[str] = []

        async def inventory(msg: Any) -> None:
            await msg.respond(b'{"reserved": true}')

        async def impostor(msg: Any) -> None:
            overheard.append(msg.subject)
            await msg.respond(b'{"reserved": false}')

        await grader.subscribe("inventory.reserve", cb=inventory)
        await learner.subscribe("inventory.reserve", cb=impostor)
        await grader.flush()
        await learner.flush()
        answers = [(await grader.request("inventory.reserve", b"{}", timeout=1)).data for _ in range(5)]
        asked = await _attempt(learner.request("inventory.reserve", b"{}", timeout=1))
        await learner.close()
        await grader.close()
        assert set(answers) == {b'{"reserved": true}'}  # only the course's inventory ever answered
        return asked, overheard

    with EmbeddedServer(config=str(config)) as server:
        asked, overheard = asyncio.run(scenario(users.grader_url(server.url), users.learner_url(server.url)))
    assert asked == "ok" and overheard == []


def test_a_machine_with_little_free_disk_still_starts_a_shared_server_with_every_slot_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    # The server reserves every slot's bound at start: by its defaults (75% of the free disk) 100 MB
    # could not hold 32 x 32 MB, and it would refuse to start.
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 100 << 20))
    users = SharedUsers()
    config = tmp_path / "shared.conf"
    config.write_text(users.config())
    assert config.read_text().startswith("jetstream ")
    monkeypatch.undo()

    async def limits(admin: str) -> int:
        nc = await nats.connect(slot_grader_url(admin, 32))
        info = await nc.jetstream().account_info()
        await nc.close()
        return int(info.limits.max_storage)

    with EmbeddedServer(config=str(config)) as server:
        assert asyncio.run(limits(users.admin_url(server.url))) == SLOT_JETSTREAM["max_file"]
