"""A classroom server: one account per learner, proven isolated on the real nats-server.

From learner A's credentials every operation on learner B's streams, consumers, subjects, key-value
bucket, acks and reply inboxes is tried; none may succeed. The same attacks between two users of
one account (what a shared server without accounts is) mostly succeed: the attacks are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from test_gradebook import CLI_DRIVER, cli

from conftest import ROOT
from msglab.broker.server import EmbeddedServer
from msglab.classroom.server import MIB, Classroom, ClassroomError, Limits, learner_names, start
from msglab.classroom.status import render, status
from msglab.grading.observe import caught_up

LIMITS = Limits(max_mem=2 * MIB, max_file=4 * MIB, max_streams=12, max_consumers=16)


@pytest.fixture
def room(tmp_path: Path) -> Iterator[Classroom]:
    """A classroom server for alice, bob and cy on 127.0.0.1 (any free ports), small limits."""
    classroom = Classroom.create(tmp_path / "classroom", ["alice", "bob", "cy"], limits=LIMITS, host="127.0.0.1",
                                 port=0, monitor_port=0)  # fmt: skip
    server = start(classroom)
    try:
        yield classroom
    finally:
        server.stop()


def test_learner_names_and_the_generated_config() -> None:
    assert learner_names("3") == ["learner01", "learner02", "learner03"]
    assert learner_names(" alice, bob ,cy") == ["alice", "bob", "cy"]
    for bad in ("alice,alice", "SYS", "instructor", "a b", "1st", ""):
        with pytest.raises(ClassroomError):
            learner_names(bad)
    classroom = Classroom(Path("/nonexistent"), {"alice": "p1", "bob": "p2"}, "ip", limits=LIMITS)
    config = classroom.config()
    assert config["system_account"] == "SYS"
    assert set(config["accounts"]) == {"SYS", "alice", "bob"}
    for name in ("alice", "bob"):
        account = config["accounts"][name]
        assert account["jetstream"] == {"max_mem": 2 * MIB, "max_file": 4 * MIB, "max_streams": 12,
                                        "max_consumers": 16}  # fmt: skip
        assert account["limits"] == {"max_connections": 32}
        assert set(account) == {"jetstream", "limits", "users"}, "no exports or imports between learner accounts"
    assert config["jetstream"] == {"max_mem": 4 * MIB, "max_file": 8 * MIB}  # every account's limits fit
    assert config["http"] == "127.0.0.1:8222"  # monitoring stays on the instructor's machine


def test_serving_the_same_folder_again_keeps_every_password(tmp_path: Path) -> None:
    first = Classroom.create(tmp_path / "c", ["alice", "bob"])
    first.save()
    again = Classroom.create(tmp_path / "c", ["alice", "bob", "cy"])
    assert again.learners["alice"] == first.learners["alice"] and again.learners["bob"] == first.learners["bob"]
    assert again.instructor_password == first.instructor_password and again.learners["cy"]
    assert oct((tmp_path / "c" / "classroom.json").stat().st_mode & 0o777) == "0o600"


# --- isolation ---------------------------------------------------------------------------------


class Victim:
    """Learner B's world: a stream with messages, a durable holding a delivered message, a service, a bucket."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.secret = "b-secret-" + secrets.token_hex(4)
        self.received: list[bytes] = []  # what reached B's own subscriptions

    async def setup(self) -> None:
        self.nc = await nats.connect(self.url, name="learner-b")
        self.js = self.nc.jetstream()
        await self.js.add_stream(name="ORDERS", subjects=["orders.>"])
        for i in range(3):
            await self.js.publish("orders.placed", f"{self.secret}-{i}".encode())
        await self.js.add_consumer("ORDERS", ConsumerConfig(durable_name="email", ack_policy=AckPolicy.EXPLICIT,
                                                            ack_wait=60))  # fmt: skip
        self.pull = await self.js.pull_subscribe_bind("email", "ORDERS")
        self.held = (await self.pull.fetch(1, timeout=2))[0]  # delivered to B, not acked yet
        self.kv = await self.js.create_key_value(bucket="PROFILE")
        await self.kv.put("card", f"{self.secret}-card".encode())

        async def echo(msg: Any) -> None:
            await msg.respond(f"{self.secret}-reply".encode())

        async def keep(msg: Any) -> None:
            self.received.append(msg.data)

        self.subs = [await self.nc.subscribe("svc.echo", cb=echo), await self.nc.subscribe("orders.>", cb=keep)]
        self.inbox = self.nc.new_inbox()
        self.subs.append(await self.nc.subscribe(self.inbox, cb=keep))
        await self.nc.flush()

    async def traffic(self) -> None:
        """What B does while A listens: publishes, requests, reads the bucket (what A destroyed fails: fine)."""
        for step in (
            lambda: self.js.publish("orders.placed", f"{self.secret}-later".encode()),
            lambda: self.nc.request("svc.echo", b"ping", timeout=1),
            lambda: self.kv.get("card"),
            lambda: self.js.stream_info("ORDERS"),
        ):
            try:
                await step()
            except Exception:  # the control's A has deleted B's things
                continue

    async def snapshot(self) -> tuple[Any, ...]:
        try:
            return await self._snapshot()
        except Exception as exc:  # something of B's is gone
            return ("gone", repr(exc))

    async def _snapshot(self) -> tuple[Any, ...]:
        info = await self.js.stream_info("ORDERS")
        consumer = await self.js.consumer_info("ORDERS", "email")
        names = sorted(str(s.config.name) for s in await self.js.streams_info())
        card = (await self.kv.get("card")).value
        return (info.state.messages, info.state.last_seq, info.config.subjects, consumer.num_ack_pending,
                consumer.num_pending, consumer.delivered.stream_seq, names, card, len(self.received))  # fmt: skip


async def attack(url_a: str, victim: Victim) -> list[tuple[str, bool, str]]:
    """Every operation A can try on B's things; (what, succeeded, what came back)."""
    nc = await nats.connect(url_a, name="learner-a", max_reconnect_attempts=0)
    js = nc.jetstream()
    spied: list[bytes] = []

    async def spy(msg: Any) -> None:
        spied.append(msg.data + msg.subject.encode())

    subs = [await nc.subscribe(subject, cb=spy) for subject in (">", "_INBOX.>", "orders.>", "$JS.>", "$KV.>")]
    answered: list[bytes] = []

    async def impostor(msg: Any) -> None:  # A's own responder on B's service subject
        answered.append(msg.data)
        await msg.respond(b"from A")

    subs.append(await nc.subscribe("svc.echo", cb=impostor))
    await nc.flush()
    marker = b"from-learner-a"
    outcomes: list[tuple[str, bool, str]] = []

    async def attempt(what: str, operation: Callable[[], Awaitable[Any]], leaked: Callable[[Any], bool]) -> None:
        before = await victim.snapshot()
        try:
            result: Any = await asyncio.wait_for(operation(), 2)
            got = leaked(result) or victim.secret in repr(result)
        except Exception as exc:  # refused, not found, no responders, timed out: it did not succeed
            result, got = exc, False
        await nc.flush()
        await victim.nc.flush()
        changed = await victim.snapshot() != before
        outcomes.append((what, got or changed, repr(result)[:160]))

    def returned(result: Any) -> bool:
        return True  # reaching B's object at all is the success: A has none of that name

    def mentions_b(result: Any) -> bool:
        text = result.data.decode(errors="replace") if hasattr(result, "data") else repr(result)
        return any(name in text for name in ("ORDERS", "PROFILE", '"email"', "learner-b", "bob"))

    def request(subject: str, body: dict[str, Any] | None = None) -> Callable[[], Awaitable[Any]]:
        return lambda: nc.request(subject, json.dumps(body or {}).encode(), timeout=1)

    # read
    await attempt("stream info", lambda: js.stream_info("ORDERS"), returned)
    await attempt("get a message", lambda: js.get_msg("ORDERS", 1), returned)
    await attempt("direct get", request("$JS.API.DIRECT.GET.ORDERS", {"seq": 1}), mentions_b)
    await attempt("consumer info", lambda: js.consumer_info("ORDERS", "email"), returned)
    await attempt("fetch from B's durable", lambda: _fetch_bound(js), returned)
    await attempt("next message over the API", request("$JS.API.CONSUMER.MSG.NEXT.ORDERS.email", {"batch": 1}),
                  mentions_b)  # fmt: skip
    await attempt("read B's bucket", lambda: _kv_get(js), returned)
    await attempt("list streams", lambda: js.streams_info(), lambda r: any(s.config.name == "ORDERS" for s in r))
    await attempt("stream names over the API", request("$JS.API.STREAM.NAMES"), mentions_b)
    await attempt("stream list over the API", request("$JS.API.STREAM.LIST"), mentions_b)
    await attempt("consumer names over the API", request("$JS.API.CONSUMER.NAMES.ORDERS"), mentions_b)
    await attempt("account info", lambda: js.account_info(), lambda r: r.streams > 0)
    # publish
    await attempt("core publish on B's subject", lambda: nc.publish("orders.placed", marker), lambda r: False)
    await attempt("JetStream publish on B's subject", lambda: js.publish("orders.placed", marker), returned)
    await attempt("request B's service", lambda: nc.request("svc.echo", marker, timeout=1), mentions_b)
    await attempt("publish to B's inbox", lambda: nc.publish(victim.inbox, marker), lambda r: False)
    await attempt("ack B's held message", lambda: nc.publish(victim.held.reply, b"+ACK"), lambda r: False)
    await attempt("nak B's held message", lambda: nc.publish(victim.held.reply, b"-NAK"), lambda r: False)
    await attempt("term B's held message", lambda: nc.publish(victim.held.reply, b"+TERM"), lambda r: False)
    # create consumers
    await attempt("durable on B's stream", lambda: js.add_consumer("ORDERS", ConsumerConfig(durable_name="spy")),
                  returned)  # fmt: skip
    await attempt("ephemeral on B's stream", request("$JS.API.CONSUMER.CREATE.ORDERS",
                                                     {"stream_name": "ORDERS", "config": {"ack_policy": "none"}}),
                  lambda r: "error" not in json.loads(r.data))  # fmt: skip
    await attempt("update B's stream", request("$JS.API.STREAM.UPDATE.ORDERS",
                                               {"name": "ORDERS", "subjects": ["orders.>", "spy.>"]}),
                  lambda r: "error" not in json.loads(r.data))  # fmt: skip
    # the system account's requests (account-scoped ones answer about A alone)
    system = ("SERVER.PING.CONNZ", "ACCOUNT.PING.CONNZ", "SERVER.PING.JSZ", "ACCOUNT.bob.CONNZ", "ACCOUNT.bob.JSZ",
              "ACCOUNT.PING.STATZ")  # fmt: skip
    for subject in (f"$SYS.REQ.{name}" for name in system):
        await attempt(f"system request {subject}", request(subject), mentions_b)
    # delete and purge, last: when one succeeds (the control) it takes B's things with it
    await attempt("delete a message", lambda: js.delete_msg("ORDERS", 2), returned)
    await attempt("purge B's stream", lambda: js.purge_stream("ORDERS"), returned)
    await attempt("delete B's durable", lambda: js.delete_consumer("ORDERS", "email"), returned)
    await attempt("delete B's bucket", lambda: js.delete_key_value("PROFILE"), returned)
    await attempt("delete B's stream", lambda: js.delete_stream("ORDERS"), returned)
    # while A listens on everything, B works: nothing of it may reach A, nothing of A's may reach B
    await victim.traffic()  # each step waits for the server's answer: its publishes are routed by then
    await caught_up(victim.nc, victim.subs)  # deliveries that never come cannot be waited on; those that did can
    await caught_up(nc, subs)
    outcomes.append(("subscribe to B's traffic", any(victim.secret.encode() in m for m in spied), f"{len(spied)} seen"))
    theirs = [data for data in answered if data != marker]  # A's own request reaches A's responder, of course
    outcomes.append(("answer B's requests", bool(theirs), f"{len(theirs)} of B's requests answered by A"))
    outcomes.append(("reach B's subscriptions", any(marker in m for m in victim.received), ""))
    await nc.close()
    return outcomes


async def _fetch_bound(js: Any) -> Any:
    sub = await js.pull_subscribe_bind("email", "ORDERS")
    return await sub.fetch(1, timeout=0.5)


async def _kv_get(js: Any) -> Any:
    kv = await js.key_value("PROFILE")
    return await kv.get("card")


async def run_attack(url_a: str, url_b: str) -> list[tuple[str, bool, str]]:
    victim = Victim(url_b)
    await victim.setup()
    try:
        return await attack(url_a, victim)
    finally:
        await victim.nc.close()


def test_no_operation_from_one_learner_reaches_another(room: Classroom) -> None:
    outcomes = asyncio.run(run_attack(room.local_url("alice"), room.local_url("bob")))
    assert len(outcomes) >= 30
    succeeded = [(what, said) for what, ok, said in outcomes if ok]
    assert succeeded == [], f"{len(succeeded)} of {len(outcomes)} cross-learner operations succeeded: {succeeded}"


def test_the_same_attacks_succeed_between_users_of_one_account(tmp_path: Path) -> None:
    """The control: without accounts, A reaches B's things (so the test above would see it if it could)."""
    config = tmp_path / "shared.conf"
    config.write_text("authorization { users: [ {user: a, password: pa}, {user: b, password: pb} ] }\n")
    with EmbeddedServer(config=str(config)) as server:
        host = server.url.removeprefix("nats://")
        outcomes = asyncio.run(run_attack(f"nats://a:pa@{host}", f"nats://b:pb@{host}"))
    succeeded = [what for what, ok, _ in outcomes if ok]
    assert len(succeeded) >= 20, succeeded


def test_a_learner_over_the_storage_limit_gets_a_clear_error_and_nobody_else_notices(room: Classroom) -> None:
    async def scenario() -> tuple[str, int, int]:
        a = await nats.connect(room.local_url("alice"))
        b = await nats.connect(room.local_url("bob"))
        ja, jb = a.jetstream(), b.jetstream()
        await ja.add_stream(name="BIG", subjects=["big.>"])
        await jb.add_stream(name="ORDERS", subjects=["orders.>"])
        said, stored = "", 0
        for _ in range(3 * LIMITS.max_file // (256 * 1024)):  # bounded: three times the limit
            try:
                await ja.publish("big.blob", b"x" * (256 * 1024))
                stored += 1
            except nats.js.errors.APIError as exc:
                said = f"{exc.err_code} {exc.description}"
                break
        for i in range(20):
            await jb.publish("orders.placed", f"order {i}".encode())
        bob = (await jb.stream_info("ORDERS")).state.messages
        await a.close()
        await b.close()
        return said, stored, bob

    said, stored, bob = asyncio.run(scenario())
    assert said == "10002 resource limits exceeded for account", said
    assert 0 < stored * 256 * 1024 <= LIMITS.max_file
    assert bob == 20


# --- the course on a learner's account ---------------------------------------------------------


def test_msglab_check_grades_on_a_learner_account_and_leaves_nothing(
    room: Classroom, monkeypatch: pytest.MonkeyPatch
) -> None:
    from msglab.grading.grade import grade

    monkeypatch.setenv("NATS_URL", room.local_url("cy"))
    verdict = grade("01", solution=True, seed=3)
    assert verdict.passed, verdict.to_text()
    assert "shared server" in verdict.server

    async def leftovers() -> list[str]:
        nc = await nats.connect(room.local_url("cy"))
        names = [str(s.config.name) for s in await nc.jetstream().streams_info()]
        await nc.close()
        return names

    assert asyncio.run(leftovers()) == []


# --- join and status ---------------------------------------------------------------------------


def test_join_saves_the_details_the_lessons_then_use(room: Classroom, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from msglab.broker import server_info
    from msglab.classroom.join import joined_url, leave

    monkeypatch.setenv("MSGLAB_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("NATS_URL", raising=False)
    handout = room.folder / "learners" / "alice.txt"
    done = cli(["join", str(handout)], env={"MSGLAB_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "joined the classroom server" in done.stdout and "as alice" in done.stdout
    assert joined_url() == room.learner_url("alice")
    assert oct((tmp_path / "state" / "classroom.json").stat().st_mode & 0o777) == "0o600"
    assert server_info().url == room.learner_url("alice")
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    assert server_info().url == "nats://127.0.0.1:1"  # NATS_URL still wins
    assert "left" in leave() and joined_url() is None
    wrong = room.learner_url("alice").replace(room.learners["alice"], "not-the-password")
    done = cli(["join", wrong], env={"MSGLAB_STATE_DIR": str(tmp_path / "other")})
    assert done.returncode == 2 and "refused" in done.stderr and not (tmp_path / "other" / "classroom.json").exists()


def test_status_shows_learners_their_streams_and_the_labs_they_passed(room: Classroom, tmp_path: Path) -> None:
    async def work() -> None:
        nc = await nats.connect(room.local_url("bob"))
        js = nc.jetstream()
        await js.add_stream(name="LESSON00_GREETINGS", subjects=["lesson00.>"])
        for _ in range(5):
            await js.publish("lesson00.hello", b"hi")
        await nc.close()

    asyncio.run(work())
    gradebook = tmp_path / "gradebook.csv"
    gradebook.write_text("learner,lab,score,max,passed,failed,seed,seconds,status,note\n"
                         "bob,01,16,16,yes,,1,2.0,graded,\nbob,02,3,10,no,x,2,2.0,graded,\n"
                         "alice,02,10,10,yes,,3,2.0,graded,\n")  # fmt: skip
    verdicts = tmp_path / "verdicts" / "cy"
    verdicts.mkdir(parents=True)
    (verdicts / "lab03.json").write_text(json.dumps({"lab": "03_idempotency", "passed": True, "seed": 1}))
    report = status(room.folder, gradebook, tmp_path / "verdicts")
    assert report.learners["bob"].streams == {"LESSON00_GREETINGS": {"messages": 5, "bytes": report.learners["bob"]
                                              .streams["LESSON00_GREETINGS"]["bytes"]}}  # fmt: skip
    assert report.learners["bob"].passed == {"01"} and report.learners["alice"].passed == {"02"}
    assert report.learners["cy"].passed == {"03"}
    text = render(report)
    assert "LESSON00_GREETINGS" in text and "nats-server" in text
    done = cli(["classroom", "status", "--dir", str(room.folder), "--gradebook", str(gradebook)])
    assert done.returncode == 0, done.stderr
    bob = next(line for line in done.stdout.splitlines() if line.strip().startswith("bob"))
    assert bob.split()[2] == "1" and "01" in bob  # one stream, lab 01 passed


def test_the_serve_command_prints_what_to_hand_out_and_stops_on_ctrl_c(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI_DRIVER, "classroom", "serve", "--learners", "2", "--dir", str(tmp_path / "room"),
         "--local", "--port", "0", "--monitor-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    reaped.append(proc)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops the server" in line:
            break
    text = "".join(lines)
    assert "2 learner accounts" in text, text
    url = next(word for word in text.split() if word.startswith("nats://learner01:"))
    monitor = next(word for word in text.split() if word.startswith("http://127.0.0.1:"))

    async def use() -> int:
        nc = await nats.connect(url)
        info = await nc.jetstream().account_info()
        await nc.close()
        return int(info.limits.max_streams)

    assert asyncio.run(use()) == 32
    with urllib.request.urlopen(monitor, timeout=5) as answer:  # the monitoring URL answers, on loopback
        assert "account_details" in json.loads(answer.read())
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0


# --- what is handed out, and how much one learner may take ---------------------------------------


def test_a_learner_opening_one_connection_too_many_is_refused_and_nobody_else_notices(tmp_path: Path) -> None:
    limits = Limits(max_mem=2 * MIB, max_file=4 * MIB, max_connections=3)
    classroom = Classroom.create(tmp_path / "room", ["alice", "bob"], limits=limits, host="127.0.0.1", port=0,
                                 monitor_port=0)  # fmt: skip
    server = start(classroom)

    async def flood() -> tuple[int, str, bool]:
        opened, refused = [], ""
        for _ in range(limits.max_connections + 1):
            try:
                opened.append(await nats.connect(classroom.local_url("alice"), allow_reconnect=False,
                                                 connect_timeout=5))  # fmt: skip
            except Exception as exc:  # nats-py raises its own Error with the server's -ERR text
                refused = str(exc)
        bob = await nats.connect(classroom.local_url("bob"), allow_reconnect=False, connect_timeout=5)
        bob_works = (await bob.jetstream().account_info()) is not None
        for nc in [*opened, bob]:
            await nc.close()
        return len(opened), refused, bob_works

    try:
        opened, refused, bob_works = asyncio.run(flood())
    finally:
        server.stop()
    assert opened == 3 and "maximum account active connections exceeded" in refused, (opened, refused)
    assert bob_works


def test_the_handout_names_an_address_learners_laptops_reach(tmp_path: Path) -> None:
    from msglab.classroom.server import advertised, machine_addresses

    for loopback in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(ClassroomError, match="loopback"):
            advertised(loopback)
    with pytest.raises(ClassroomError, match="does not resolve"):
        advertised("no-such-room-host.invalid")
    with pytest.raises(ClassroomError, match="--advertise ADDRESS") as raised:
        advertised("")
    assert all(address in str(raised.value) for address in machine_addresses())
    assert advertised("", local=True) == "127.0.0.1" and advertised("localhost", local=True) == "localhost"
    # 192.0.2.0/24 is documentation space: never connected to here, only written into the handouts.
    room = Classroom.create(tmp_path / "room", ["alice"], host="127.0.0.1", port=0, monitor_port=0,
                            advertise=advertised("192.0.2.10"))  # fmt: skip
    server = start(room)
    try:
        handout = (tmp_path / "room" / "learners" / "alice.txt").read_text()
    finally:
        server.stop()
    assert f"@192.0.2.10:{room.bound_port}" in handout and "127.0.0.1" not in handout
    done = cli(["classroom", "serve", "--learners", "2", "--dir", str(tmp_path / "nowhere"), "--port", "0"])
    assert done.returncode == 2 and "--advertise ADDRESS" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "nowhere").exists(), "nothing is written before the address is known"


# --- a TLS room ----------------------------------------------------------------------------------


@pytest.fixture
def tls_room(tmp_path: Path) -> Iterator[Classroom]:
    """A classroom server that requires TLS, for alice and bob on 127.0.0.1 (any free ports)."""
    classroom = Classroom.create(tmp_path / "tls-room", ["alice", "bob"], limits=LIMITS, host="127.0.0.1", port=0,
                                 monitor_port=0, tls=True)  # fmt: skip
    server = start(classroom)
    try:
        yield classroom
    finally:
        server.stop()


async def _refusal(url: str, **options: Any) -> str:
    """What nats-py says when `url` does not take the connection ("" if it does)."""
    said: list[Exception] = []

    async def quiet(exc: Exception) -> None:
        said.append(exc)

    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5, error_cb=quiet, **options)
    except Exception as exc:
        return repr(said[0] if said else exc)
    await nc.jetstream().account_info()
    await nc.close()
    return ""


def test_a_tls_room_takes_a_learner_who_has_its_ca_and_no_client_without_it(tls_room: Classroom,
                                                                            tmp_path: Path) -> None:  # fmt: skip
    from cryptography import x509

    from msglab.broker import tls_context
    from msglab.classroom.server import make_certificates

    url = tls_room.local_url("alice")
    assert url.startswith("tls://") and tls_room.learner_url("alice").startswith("tls://")
    assert asyncio.run(_refusal(url, **tls_room.tls_options())) == ""
    # No CA: nats-py checks against the system's CAs and refuses, nats:// or tls:// alike (the server requires TLS).
    for plain in (url, url.replace("tls://", "nats://")):
        assert "CERTIFICATE_VERIFY_FAILED" in asyncio.run(_refusal(plain)), plain
    make_certificates(tmp_path / "other-room", ["127.0.0.1"])  # another room's CA, same names: not this room's
    other = tls_context((tmp_path / "other-room" / "ca.pem").read_text())
    assert "CERTIFICATE_VERIFY_FAILED" in asyncio.run(_refusal(url, tls=other))
    block = tls_room.config()["tls"]  # required of every client; a client may start with the handshake
    assert "allow_non_tls" not in block and block["handshake_first"] == "1s", block
    # What was written: the CA key for the instructor alone, a server certificate naming the room's addresses.
    folder = tls_room.folder / "tls"
    for key in ("ca-key.pem", "server-key.pem"):
        assert oct((folder / key).stat().st_mode & 0o777) == "0o600", key
    cert = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    handout = (tls_room.folder / "learners" / "alice.txt").read_text()
    assert tls_room.learner_url("alice") in handout and tls_room.ca_pem().strip() in handout


def test_a_tls_room_keeps_its_ca_across_restarts_and_names_the_advertised_address(tmp_path: Path) -> None:
    from cryptography import x509

    room = Classroom.create(tmp_path / "room", ["alice"], host="127.0.0.1", port=0, monitor_port=0, tls=True)
    start(room).stop()
    ca = room.ca_pem()
    # Served again for another address (documentation space: only written into the certificate and handouts).
    again = Classroom.create(tmp_path / "room", ["alice"], host="127.0.0.1", port=0, monitor_port=0, tls=True,
                             advertise="192.0.2.10")  # fmt: skip
    start(again).stop()
    assert again.ca_pem() == ca, "the CA handed out stays valid"
    cert = x509.load_pem_x509_certificate((tmp_path / "room" / "tls" / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"192.0.2.10", "127.0.0.1"}
    assert "tls://alice:" in (tmp_path / "room" / "learners" / "alice.txt").read_text()


def test_in_a_tls_room_a_password_never_crosses_the_network_in_clear(tls_room: Classroom) -> None:
    """Every byte clients send passes a relay that keeps them; the server refuses a CONNECT sent in clear."""
    password = tls_room.learners["alice"].encode()
    sent = bytearray()
    first_bytes: list[bytes] = []  # what each client said before the server said anything

    async def scenario() -> tuple[str, str, bytes, bytes]:
        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", tls_room.bound_port)
            answered = asyncio.Event()

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bool) -> None:
                while data := await src.read(65536):
                    if keep:
                        if not answered.is_set():
                            first_bytes.append(data)
                        sent.extend(data)
                    else:
                        answered.set()
                    dst.write(data)
                    await dst.drain()
                dst.close()

            await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False),
                                 return_exceptions=True)  # fmt: skip

        proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
        port = proxy.sockets[0].getsockname()[1]
        via = tls_room.local_url("alice").replace(f":{tls_room.bound_port}", f":{port}")
        with_ca = await _refusal(via, **tls_room.tls_options())
        without_ca = await _refusal(via.replace("tls://", "nats://"))
        proxy.close()
        # A client that ignores tls_required and sends its CONNECT in clear is cut off: no +OK, no PONG.
        reader, writer = await asyncio.open_connection("127.0.0.1", tls_room.bound_port)
        info = await reader.readline()
        writer.write(b'CONNECT {"verbose":true,"user":"alice","pass":"' + password + b'"}\r\nPING\r\n')
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return with_ca, without_ca, info, answer

    with_ca, without_ca, info, answer = asyncio.run(scenario())
    assert with_ca == "" and "CERTIFICATE_VERIFY_FAILED" in without_ca, (with_ca, without_ca)
    assert len(sent) > 500, "the relay carried both clients' traffic"
    # The course's client starts with the TLS handshake (a record of type 22), before the server's INFO.
    assert first_bytes and first_bytes[0][:1] == b"\x16", first_bytes[:1]
    assert password not in sent and b"CONNECT" not in sent, "only TLS records went to the server"
    assert json.loads(info.split(b" ", 1)[1])["tls_required"] is True
    assert b"+OK" not in answer and b"PONG" not in answer, answer


def test_join_with_a_tls_handout_then_the_course_connects_checking_the_room(
    tls_room: Classroom, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from msglab.broker import connect, server_info
    from msglab.classroom.join import joined_ca, joined_url
    from msglab.classroom.server import make_certificates
    from msglab.errors import ServerUnreachable

    async def streams(**options: Any) -> int:
        nc = await connect(**options)
        try:
            return int((await nc.jetstream().account_info()).streams)
        finally:
            await nc.close()

    state = tmp_path / "state"
    monkeypatch.setenv("MSGLAB_STATE_DIR", str(state))
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("NATS_CA", raising=False)
    # The bare URL, without the room's certificate (tls://, or nats:// typed by hand): refused with what to do.
    for bare in (tls_room.learner_url("alice"), tls_room.learner_url("alice").replace("tls://", "nats://")):
        done = cli(["join", bare], env={"MSGLAB_STATE_DIR": str(state)})
        assert done.returncode == 2 and "does not check out against any CA this machine trusts" in done.stderr
        assert "handed out" in done.stderr and "Traceback" not in done.stderr and joined_url() is None, done.stderr
    # The handout: one step.
    done = cli(["join", str(tls_room.folder / "learners" / "alice.txt")], env={"MSGLAB_STATE_DIR": str(state)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "as alice" in done.stdout and "TLS" in done.stdout
    assert joined_url() == tls_room.learner_url("alice") and joined_ca() == tls_room.ca_pem().strip()
    assert server_info().url == tls_room.learner_url("alice")
    assert asyncio.run(streams()) == 0  # what a lesson's msglab.connect() does: checked against the room's CA
    assert not [r for r in caplog.records if "ssl" in r.getMessage()], "a lesson's output stays clean"
    # NATS_URL (a shell, `msglab check` on the room) with NATS_CA: a file, or the PEM itself.
    monkeypatch.setenv("MSGLAB_STATE_DIR", str(tmp_path / "nobody"))
    monkeypatch.setenv("NATS_URL", tls_room.local_url("bob"))
    for ca in (str(tls_room.ca_file), tls_room.ca_pem(), str(state / "room-ca.pem")):
        monkeypatch.setenv("NATS_CA", ca)
        assert asyncio.run(streams()) == 0
    monkeypatch.setenv("NATS_URL", tls_room.local_url("bob").replace("tls://", "nats://"))
    assert asyncio.run(streams()) == 0  # the plain scheme with the room's CA: TLS all the same
    make_certificates(tmp_path / "other-room", ["127.0.0.1"])
    for ca in ("", str(tmp_path / "other-room" / "ca.pem")):  # no CA; another room's
        monkeypatch.setenv("NATS_CA", ca)
        with pytest.raises(ServerUnreachable, match="does not check out"):
            asyncio.run(streams())
    assert not [r for r in caplog.records if "encountered error" in r.getMessage()], "only the course's message"
    # NATS_CA left set, NATS_URL not: a server the course starts for itself (no TLS) is still reached.
    monkeypatch.setenv("NATS_CA", str(tls_room.ca_file))
    monkeypatch.delenv("NATS_URL")
    with EmbeddedServer() as plain:
        assert asyncio.run(streams(url=plain.url)) == 0
    # --ca with the bare URL works too.
    done = cli(["join", tls_room.learner_url("bob"), "--ca", str(tls_room.ca_file)],
               env={"MSGLAB_STATE_DIR": str(tmp_path / "bob")})  # fmt: skip
    assert done.returncode == 0 and "as bob" in done.stdout, done.stdout + done.stderr


def test_classroom_serve_tls_hands_out_files_learners_join_with_and_status_reads_the_room(
    tmp_path: Path, reaped: list[subprocess.Popen[str]]
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "NATS_CA")}
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI_DRIVER, "classroom", "serve", "--learners", "2", "--dir", str(tmp_path / "room"),
         "--local", "--port", "0", "--monitor-port", "0", "--tls"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    reaped.append(proc)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops the server" in line:
            break
    text = "".join(lines)
    try:
        assert "tls://127.0.0.1:" in text and "TLS required" in text and "msglab join learner01.txt" in text, text
        done = cli(["join", str(tmp_path / "room" / "learners" / "learner01.txt")],
                   env={"MSGLAB_STATE_DIR": str(tmp_path / "state")})  # fmt: skip
        assert done.returncode == 0 and "as learner01" in done.stdout, done.stdout + done.stderr
        done = cli(["classroom", "status", "--dir", str(tmp_path / "room")])
        assert done.returncode == 0 and "nats-server" in done.stdout, done.stdout + done.stderr
        learner01 = next(row for row in done.stdout.splitlines() if row.strip().startswith("learner01"))
        assert learner01.split()[1] == "0", learner01  # its connections, read over TLS as the instructor
    finally:
        proc.send_signal(signal.SIGTERM)  # what a service manager sends: stopped like Ctrl-C
        assert proc.wait(30) == 0
    from msglab.broker import probe
    from msglab.errors import ServerUnreachable

    port = text.split("tls://127.0.0.1:")[1].split()[0]
    with pytest.raises(ServerUnreachable):  # the room's server stopped with it, not left behind
        probe(f"tls://127.0.0.1:{port}")


def test_serve_tls_without_the_cryptography_package_says_what_to_install(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['cryptography'] = None\n"  # as on a machine without msglab[classroom]
            "from pathlib import Path\nfrom msglab.classroom.server import ClassroomError, make_certificates\n"
            "try:\n    make_certificates(Path(sys.argv[1]), ['127.0.0.1'])\n"
            "except ClassroomError as exc:\n    print(exc)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tls")], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)  # fmt: skip
    assert "pip install 'msglab[classroom]'" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "tls").exists()


def test_a_sealed_learner_process_reaches_a_tls_room_with_the_ca_in_its_environment(
    tls_room: Classroom, tmp_path: Path
) -> None:
    """What a graded learner process has: NATS_URL, NATS_CA as the PEM itself (its uid may not read the
    learner's files), msglab.classroom sealed."""
    code = (
        "import asyncio, os, nats\n"
        "from msglab.grading.sandbox import seal_course\n"
        "seal_course()\n"
        "from msglab.broker import tls_options\n"
        "async def main():\n"
        "    url = os.environ['NATS_URL']\n"
        "    nc = await nats.connect(url, allow_reconnect=False, **tls_options(url))\n"
        "    print('streams', (await nc.jetstream().account_info()).streams)\n"
        "    await nc.close()\n"
        "asyncio.run(main())\n"
    )  # fmt: skip
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "MSGLAB_STATE_DIR": str(tmp_path / "state"),
           "NATS_URL": tls_room.local_url("bob"), "NATS_CA": tls_room.ca_pem()}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "streams 0" in done.stdout, done.stdout + done.stderr[-3000:]


def test_lesson_00_runs_three_times_at_once_on_a_tls_room_each_learner_joined_from_a_handout(tmp_path: Path) -> None:
    """A room as a workshop uses it: three learners, each joined from the handout, run the same lesson at once."""
    names = ["alice", "bob", "cy"]
    room = Classroom.create(tmp_path / "tls-room", names, limits=LIMITS, host="127.0.0.1", port=0, monitor_port=0,
                            tls=True)  # fmt: skip
    server = start(room)
    try:
        lesson = sorted((ROOT / "lessons").glob("00_*.ipynb"))[0]
        runs = []
        for name in names:
            state = tmp_path / f"state-{name}"
            done = cli(["join", str(room.folder / "learners" / f"{name}.txt")], env={"MSGLAB_STATE_DIR": str(state)})
            assert done.returncode == 0, done.stdout + done.stderr
            env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "NATS_CA", "MSGLAB_SERVER_VERSION")}
            env["MSGLAB_STATE_DIR"] = str(state)
            # A kernel as VS Code or a plain `jupyter lab` starts it: no NATS_URL, the joined account (nbval's
            # conftest.py would give the kernel a state folder of its own). Any error in a cell fails the run.
            runs.append(subprocess.Popen(
                [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--output-dir",
                 str(tmp_path / name), "--ExecutePreprocessor.timeout=120", str(lesson)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))  # fmt: skip
        said = [run.communicate(timeout=600)[0] for run in runs]
        for name, run, output in zip(names, runs, said, strict=True):
            assert run.returncode == 0, f"{lesson.name} as {name}:\n{output[-5000:]}"
            executed = json.loads((tmp_path / name / lesson.name).read_text())
            texts = [o["text"] for c in executed["cells"] for o in c.get("outputs", []) if "text" in o]
            shown = "".join(t if isinstance(t, str) else "".join(t) for t in texts)
            assert "your classroom account" in shown and "ssl" not in shown, shown[:3000]
            # The server's own record: the lesson's connections were this learner's, TLS from their first byte,
            # and did work.
            with urllib.request.urlopen(
                f"{room.monitor_url}/connz?state=closed&auth=true&acc={name}", timeout=5
            ) as got:
                closed = json.loads(got.read())["connections"]
            assert closed and all(c["account"] == name and c["tls_version"] and c["tls_first"] for c in closed), closed
            assert sum(c["in_msgs"] for c in closed) >= 5, [(c["name"], c["in_msgs"]) for c in closed]

        async def streams(name: str) -> list[str]:  # and each run cleaned up after itself
            nc = await nats.connect(room.local_url(name), **room.tls_options())
            found = [str(s.config.name) for s in await nc.jetstream().streams_info()]
            await nc.close()
            return found

        assert [asyncio.run(streams(name)) for name in names] == [[], [], []]
    finally:
        server.stop()


def test_msglab_check_grades_on_a_tls_room(tls_room: Classroom, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grader, its course services and the sandboxed learner processes all reach the room over TLS,
    checked against the room's CA (the learner processes get it as the PEM in NATS_CA)."""
    from msglab.grading.grade import grade

    monkeypatch.setenv("NATS_URL", tls_room.local_url("bob"))
    monkeypatch.setenv("NATS_CA", tls_room.ca_pem())
    verdict = grade("01", solution=True, seed=3)
    assert verdict.passed, verdict.to_text()
    assert "shared server" in verdict.server


class PlainGreeter:
    """A real socket server on 127.0.0.1 that greets like a NATS server without TLS (what someone on the path
    would answer with) and keeps what each client sends before it gives up."""

    INFO = (b'INFO {"server_id":"FAKE","version":"2.15.1","proto":1,"headers":true,"max_payload":1048576,'
            b'"auth_required":true,"tls_required":false,"jetstream":true}\r\n')  # fmt: skip

    def __init__(self) -> None:
        import socket
        import threading

        self.heard: list[bytes] = []  # one entry per connection
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._socket.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(client,), daemon=True).start()

    def _greet(self, client: Any) -> None:
        kept = bytearray()
        self.heard.append(b"")
        index = len(self.heard) - 1
        with client:
            client.settimeout(10)
            try:
                client.sendall(self.INFO)
                while data := client.recv(65536):
                    kept.extend(data)
                    self.heard[index] = bytes(kept)
                    if b"\r\n" in kept and not kept.startswith(b"\x16"):
                        return  # a whole protocol line in clear: what was to be shown
            except OSError:
                pass

    def close(self) -> None:
        self._socket.close()


def test_a_greeting_without_tls_gets_no_password_from_the_course_once_it_knows_the_rooms_ca(
    tls_room: Classroom, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the URL's scheme, a server the course knows a room's CA for gets the TLS handshake first: a fake
    server's INFO with tls_required false (someone on the path) hears no CONNECT, no password, in each path."""
    from msglab.broker import connect
    from msglab.classroom.join import join, joined_url
    from msglab.errors import ServerUnreachable

    fake = PlainGreeter()
    password = tls_room.learners["alice"]
    plain = f"nats://alice:{password}@127.0.0.1:{fake.port}"
    ca = str(tls_room.ca_file)
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("NATS_CA", raising=False)
    try:
        # Control: a client that knows no CA sends its password in clear to this greeting (the attack is real).
        # How nats-py gives up on a server that hangs up varies (an error it reports, or one it raises).
        with contextlib.suppress(Exception, asyncio.CancelledError):
            asyncio.run(_refusal(plain))
        assert fake.heard and password.encode() in fake.heard[-1], fake.heard
        said: dict[str, str] = {}
        heard_before = len(fake.heard)
        # 1. msglab join nats://... --ca ca.pem
        done = cli(["join", plain, "--ca", ca], env={"MSGLAB_STATE_DIR": str(tmp_path / "one")})
        said["join --ca"] = done.stderr
        assert done.returncode == 2 and "TLS handshake" in done.stderr, done.stdout + done.stderr
        # 2. msglab join nats://... without --ca, the room's CA known from an earlier join to that server.
        state = tmp_path / "two"
        monkeypatch.setenv("MSGLAB_STATE_DIR", str(state))
        join(plain.replace("nats://", "tls://"), check=False, ca_file=ca)
        done = cli(["join", plain], env={"MSGLAB_STATE_DIR": str(state)})
        said["join, joined before"] = done.stderr
        assert done.returncode == 2 and "TLS handshake" in done.stderr, done.stdout + done.stderr
        # The handout's tls:// URL typed by hand, no CA anywhere: handshake first all the same.
        done = cli(["join", plain.replace("nats://", "tls://")], env={"MSGLAB_STATE_DIR": str(tmp_path / "five")})
        said["join tls://, no CA"] = done.stderr
        assert done.returncode == 2 and "TLS handshake" in done.stderr, done.stdout + done.stderr
        # 4. connect() in that joined state with NATS_URL=nats://...
        monkeypatch.setenv("NATS_URL", plain)
        with pytest.raises(ServerUnreachable, match="TLS handshake") as refused:
            asyncio.run(connect())
        said["connect, joined"] = str(refused.value)
        # 3. connect() with NATS_URL=nats://... and NATS_CA naming the room's CA, joined nowhere.
        monkeypatch.setenv("MSGLAB_STATE_DIR", str(tmp_path / "nobody"))
        monkeypatch.setenv("NATS_CA", ca)
        with pytest.raises(ServerUnreachable, match="TLS handshake") as refused:
            asyncio.run(connect())
        said["connect, NATS_CA"] = str(refused.value)
    finally:
        fake.close()
    tried = fake.heard[heard_before:]
    assert len(tried) >= 5, tried  # each path reached the fake server
    assert all(first.startswith(b"\x16") for first in tried if first), tried  # a TLS record, nothing else
    assert not [first for first in tried if password.encode() in first or b"CONNECT" in first], tried
    for path, message in said.items():
        assert password not in message and "Traceback" not in message, (path, message)
    assert not [r for r in caplog.records if "encountered error" in r.getMessage()], "only the course's message"
    monkeypatch.delenv("NATS_URL")
    monkeypatch.delenv("NATS_CA")
    monkeypatch.setenv("MSGLAB_STATE_DIR", str(tmp_path / "three"))
    # Against the real room, join with the plain scheme and the CA saves tls://: later connections start with TLS.
    join(tls_room.learner_url("alice").replace("tls://", "nats://"), ca_file=ca)
    assert joined_url() == tls_room.learner_url("alice")


def test_joining_a_stopped_room_or_with_another_rooms_ca_says_what_to_do_and_never_the_password(
    tls_room: Classroom, tmp_path: Path
) -> None:
    from msglab.classroom.server import make_certificates

    env = {"MSGLAB_STATE_DIR": str(tmp_path / "state")}
    stopped = Classroom.create(tmp_path / "stopped", ["alice"], host="127.0.0.1", port=0, monitor_port=0, tls=True)
    start(stopped).stop()
    handout = stopped.folder / "learners" / "alice.txt"
    assert "grades on a fresh server of its own" in handout.read_text()  # what `msglab check` does once joined
    done = cli(["join", str(handout)], env=env)
    assert done.returncode == 2 and "no classroom server answers" in done.stderr, done.stderr
    assert stopped.learners["alice"] not in done.stderr and "alice:***@" in done.stderr, done.stderr
    assert "ask your instructor" in done.stderr and "msglab server" not in done.stderr, done.stderr
    # Another room's CA given with --ca: the message names --ca, not the handout.
    make_certificates(tmp_path / "other-room", ["127.0.0.1"])
    other = str(tmp_path / "other-room" / "ca.pem")
    done = cli(["join", tls_room.learner_url("alice"), "--ca", other], env=env)
    assert done.returncode == 2 and f"--ca {other}" in done.stderr and "handout" not in done.stderr.split("hint")[0]
    assert tls_room.learners["alice"] not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_msglab_check_on_a_tls_room_without_its_ca_says_only_the_courses_message(
    tls_room: Classroom, tmp_path: Path
) -> None:
    env = {"NATS_URL": tls_room.local_url("bob"), "NATS_CA": "", "MSGLAB_STATE_DIR": str(tmp_path / "nobody")}
    done = cli(["check", "01"], env=env)
    assert done.returncode == 2 and "does not check out" in done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "encountered error" not in done.stderr, done.stderr
