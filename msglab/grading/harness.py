"""The grader's side of a run: an isolated broker, the effect log, and learner processes.

A `Run` owns everything one grading run creates and removes all of it on exit: its own fresh
nats-server with a grader user and a restricted learner user (or, when NATS_URL names a shared
one, names prefixed with a random run id), a folder of its own (the learner's files copied in,
the learner processes' HOME), the effect log in its own memory, and every child process it
spawned, each confined as msglab.grading.sandbox describes and SIGKILLed whole at the end.

Learner processes may write only `run.home` (their HOME and TMPDIR; owned by the run's sandbox
user): put there any file they must write, such as a lab's database. They run a copy of the
graded file (`run.source`), not the course's. Run folders sit in `runs_folder()` (0711: nobody
else lists them); a run's `src/` is readable by the grader and the run's own user only. The grader
reads what learner code could write only through msglab.grading.effects' learner-file readers
(never blocking on a FIFO, never through a symlink); should a grader block anyway, grade.py's
watchdog ends the run from outside (`Run.abandon`).

Each child has two channels to the grader (see msglab.grading.runner): JSON lines on stdout,
and a private socket for effects. The grader answers every effect call itself: it counts the
call, fires the child's planned crash if this is the call the plan names (the plan never
leaves the grader), records the effect with the grader's clock, and only then replies. Once the
grader registers the keys it published (`run.workload.add(key)`), calls about anything else are
decoys that no crash point counts (`Workload`, `Run.workload_check`); where it also asks for it
(`run.workload.held(...)`), a call counts only about a message the broker delivered to that very
process: each process gets an inbox of its own, and the grader takes a copy of what the server
delivers there.
Anything a child writes that does not follow the protocol ends that child, never the grader.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import itertools
import json
import os
import re
import secrets
import signal
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from msglab.broker import connect, delete_streams, trusted_ca
from msglab.broker.server import EmbeddedServer, _pid_alive
from msglab.broker.users import (
    LEARNER_INBOX,
    SLOTS,
    RunUsers,
    admin_password_of,
    slot_grader_url,
    slot_prefix,
    slot_url,
)
from msglab.catalog import course_root
from msglab.errors import GraderError
from msglab.grading import nemesis, observe, rules
from msglab.grading.effects import EffectLog, Event, LearnerFileError, read_learner_file
from msglab.grading.labkit import Names
from msglab.grading.nemesis import Crash
from msglab.grading.sandbox import Sandbox, bounded_home, limit_hit, protect_solutions, remove_run_folder
from msglab.grading.verdict import Check
from msglab.grading.zygote import LearnerProcess, Zygote

LINE_LIMIT = 1 << 20  # the longest protocol line a child may send (bytes)
MESSAGE_LIMIT = 20_000  # protocol messages or effect calls one child may send in a run
RUN_PREFIX = "msglab-run-"
RESERVED_DETAIL = frozenset({"call", "pid", "role", "kind", "name", "key", "self", "child"})
SOURCE_LIMIT = 4 << 20  # the most of one learner source file a run copies (bytes)
FLOOD_BYTES = 50 * LINE_LIMIT  # output beyond this is called a flood in the verdict
OUTPUT_LINES = 50  # lines of a child's stderr kept for the verdict
OUTPUT_LINE_CHARS = 300  # characters kept of each of those lines
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b.|[\x00-\x08\x0b-\x1f\x7f]")


def clean_line(raw: bytes | str) -> str:
    """One line of learner output made safe to quote: no terminal escapes, bounded length."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    text = _ESCAPES.sub("", text.rstrip("\r\n"))
    return text if len(text) <= OUTPUT_LINE_CHARS else text[:OUTPUT_LINE_CHARS] + " …"


class BrokenLearnerFile(Exception):
    """The learner's file did not import; grading turns this into a failing verdict, not an error."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        super().__init__(f"{info.get('error')}: {info.get('message')}")


class Refuse(Exception):
    """Raised by an effect handler: the child's call raises `error` (a class the grader module or builtins define)."""

    def __init__(self, error: str, message: str = "") -> None:
        super().__init__(message)
        self.error = error
        self.message = message


@dataclass
class Reply:
    """What one command to a child returned."""

    ok: bool
    elapsed: float
    value: Any = None
    error: str = ""
    message: str = ""
    where: str = ""
    hung: bool = False  # the grader had to kill the child: the call did not return in time
    gone: bool = False  # the child was already dead, or died during the call

    def describe(self) -> str:
        if self.hung:
            return f"did not return within {self.elapsed:.1f} s (the grader stopped it)"
        if self.gone:
            return "could not complete: the process died"
        if self.ok:
            return f"returned {self.value!r} after {self.elapsed:.3f} s"
        where = f" at {self.where}" if self.where else ""
        return f"raised {self.error}({self.message}){where} after {self.elapsed:.3f} s"


EffectHandler = Callable[["Child", str | None, dict[str, Any], int], Awaitable[Any]]


@dataclass
class Child:
    """One learner process: a worker the grader can kill, or a service it calls."""

    role: str
    proc: LearnerProcess
    faults: list[Crash] = field(default_factory=list)  # the plan for this process; it never sees it
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES))
    calls: Counter[str] = field(default_factory=Counter)  # effect calls crash points count, by name (no decoys)
    all_calls: int = 0  # every effect call, decoys too (bounded by MESSAGE_LIMIT)
    decoys: list[tuple[str, str]] = field(default_factory=list)  # (effect, key) calls about no message of the run
    # Calls about a message of the run that no crash point counts (Workload.held / first_only): (effect, key, why)
    uncounted: list[tuple[str, str, str]] = field(default_factory=list)
    inbox: str = ""  # this process's own inbox prefix (MSGLAB_INBOX), where the server delivers its messages
    delivered: set[str] = field(default_factory=set)  # the run's keys of messages the server delivered to `inbox`
    counted: set[tuple[str, str]] = field(default_factory=set)  # (effect, key) calls a crash point counted
    _deliveries: Any = None  # the grader's subscription on `inbox`
    fired: list[Crash] = field(default_factory=list)
    killed: str = ""  # "nemesis" or "grader": who ended it; empty if it died by itself
    broken: dict[str, Any] | None = None  # set when the learner's file did not import
    died: dict[str, Any] | None = None  # set when a worker role raised (with its traceback)
    returned: bool = False  # a worker role returned on its own
    protocol_error: str = ""  # what the child wrote that broke the protocol
    flood: bool = False  # its stderr went over the line limit
    _ready: asyncio.Future[dict[str, Any]] | None = None
    _replies: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    _next_id: int = 0
    _fx_writer: asyncio.StreamWriter | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @property
    def unplanned(self) -> bool:
        """It ended, and neither the nemesis nor the grader ended it."""
        return not self.alive and not self.killed and self.broken is None

    def how_it_ended(self) -> str:
        """One line for a verdict: why this process is gone."""
        limit = limit_hit(self.proc.returncode, self.died)
        if limit:
            return f"was stopped by the {limit} every learner process runs under"
        if self.died:
            where = f" at {self.died['where']}" if self.died.get("where") else ""
            return f"raised {self.died.get('error')}({self.died.get('message')}){where}"
        if self.protocol_error:
            return f"was stopped by the grader: {self.protocol_error}"
        if self.returned:
            return "returned on its own (a worker must keep running until it is stopped)"
        if self.killed == "nemesis":
            return "was killed by a planned fault (SIGKILL, injected)"
        if self.killed:
            return "was stopped by the grader (SIGKILL)"
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by signal {signal.Signals(-code).name} (not by the grader)"
        if self.flood:
            return f"exited with status {code} after printing more than {FLOOD_BYTES >> 20} MB"
        return f"exited with status {code}"

    def _protocol_violation(self, what: str) -> None:
        if not self.protocol_error:
            self.protocol_error = what
        self.kill_now("grader")

    def kill_now(self, by: str) -> None:
        """SIGKILL the child's whole process group at once, as a crash would: no cleanup runs."""
        if not self.killed and self.alive:
            self.killed = by
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def kill(self, by: str = "grader") -> None:
        """SIGKILL the process group and wait for the process to be gone."""
        self.kill_now(by)
        await self.exited()

    async def exited(self) -> None:
        """Return once the process has exited.

        Not `proc.wait()`: asyncio's wait also waits for the pipes to close, and a child the
        learner's code forked keeps them open for as long as it lives.
        """
        polls = 0
        while self.proc.returncode is None:
            await asyncio.sleep(0.005)
            polls += 1
            # The zygote reports every exit; should a report not come, the process's own state decides.
            if polls % 200 == 0 and self.proc.gone():
                self.proc.returncode = -signal.SIGKILL

    async def call(self, op: str, timeout: float, **args: Any) -> Reply:
        """Ask a service child to run op; kill it if it does not answer within timeout."""
        if not self.alive:
            return Reply(ok=False, elapsed=0.0, gone=True)
        assert self.proc.stdin is not None
        self._next_id += 1
        started = time.perf_counter()
        try:
            self.proc.stdin.write((json.dumps({"id": self._next_id, "op": op, "args": args}) + "\n").encode())
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            return Reply(ok=False, elapsed=time.perf_counter() - started, gone=True)
        while True:
            try:
                message = await asyncio.wait_for(self._replies.get(), timeout)
            except TimeoutError:
                await self.kill()
                return Reply(ok=False, elapsed=time.perf_counter() - started, hung=True)
            if not message:  # the channel closed: the process is gone
                return Reply(ok=False, elapsed=time.perf_counter() - started, gone=True)
            if message.get("id") == self._next_id:
                break
        try:
            return Reply(
                ok=bool(message.get("ok")),
                elapsed=time.perf_counter() - started,  # the grader's clock, never the child's word
                value=message.get("value"),
                error=str(message.get("error", ""))[:200],
                message=str(message.get("message", ""))[:500],
                where=str(message.get("where", ""))[:200],
            )
        except (TypeError, ValueError):
            self._protocol_violation("it sent a malformed reply")
            return Reply(ok=False, elapsed=time.perf_counter() - started, gone=True)

    async def wait_exit(self, timeout: float) -> bool:
        """Wait for the process to end by itself; False if it is still running at the deadline."""
        try:
            await asyncio.wait_for(self.exited(), timeout)
        except TimeoutError:
            return False
        return True


ASK_INTERVAL = 0.025  # seconds between two questions to the broker while waiting for a condition


class Workload:
    """The business keys of the messages this run published: what a planned fault must land on.

    Crash points count effect calls (`Crash("send_email", 3)`), so a worker that first makes calls about
    orders that do not exist would absorb every planned SIGKILL while holding no real work. Once a grader
    registers its keys (`run.workload.add(key)` beside each publish; the one line a grader, or
    scaffold's Topology.publish, adds), a call whose key names none of them is a decoy: answered as
    usual, but never counted towards a crash, and kept for `Run.workload_check`. A call with no key
    (`held`) counts as before. Until a key is registered every call counts, unless the grader named the
    judged effects (`only`): then a call before the first publish is a decoy too (it names nothing yet).
    """

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.effects: set[str] | None = None  # the effects whose keys name messages (None: every effect)
        self.held_effects: set[str] = set()  # counted only about a message delivered to the calling process
        self.first_effects: set[str] = set()  # counted only on a process's first call about a key
        self.key_of: Callable[[bytes, dict[str, str]], set[str]] | None = None  # the run's keys a message names

    def add(self, *keys: object) -> None:
        """Register the keys of messages the run published (or is about to)."""
        self.keys.update(str(key) for key in keys)

    def only(self, *effects: str) -> None:
        """Judge only these effects' keys (e.g. 'send_email'); others count as before."""
        self.effects = set(effects)

    def decoy(self, name: str, key: str | None) -> bool:
        """A call about no message of this run (only once the grader registered keys)."""
        judged = self.effects is None or name in self.effects
        armed = bool(self.keys) or self.effects is not None
        return armed and judged and key is not None and key not in self.keys

    def held(self, *effects: str, key_of: Callable[[bytes, dict[str, str]], set[str]] | None = None) -> None:
        """Count these effects' calls only about a message the server delivered to the calling process.

        A decoy may name a real message (published, guessed from its name, or seen in a sibling's
        delivery) that its process does not hold: a kill on that call costs the run nothing. Which keys
        a delivered message carries: `key_of(data, headers)`, by default every registered key its body
        or headers name as a whole word. Call it before the first spawn.
        """
        self.held_effects.update(effects)
        if key_of is not None:
            self.key_of = key_of

    def first_only(self, *effects: str) -> None:
        """Count these effects' calls only on a process's first call about a key (an answer, given once)."""
        self.first_effects.update(effects)

    def keys_in(self, data: bytes, headers: dict[str, str] | None) -> set[str]:
        """The registered keys a delivered message names."""
        if self.key_of is not None:
            with contextlib.suppress(Exception):  # a message the learner wrote may be anything
                return {key for key in self.key_of(data, headers or {}) if key in self.keys}
            return set()
        text = data[:KEY_SCAN].decode("utf-8", "replace") + " " + " ".join(map(str, (headers or {}).values()))
        return {word for word in _WORD.findall(text) if word in self.keys}


KEY_SCAN = 1 << 16  # the bytes of a delivered message searched for the run's keys
_WORD = re.compile(r"[A-Za-z0-9_#-]+")  # a key as a whole word: o-1 is not found inside o-10


@dataclass
class _Deliveries:
    """The grader's copy of one learner process's inbox: the run's keys a stream delivered there."""

    workload: Workload
    root: str  # the learner's inbox subjects: a message under them was published on an inbox, not delivered
    child: Child | None = None
    sub: Any = None

    async def on_message(self, msg: Any) -> None:
        subject, reply = msg.subject or "", msg.reply or ""
        if self.child is None or not reply.startswith("$JS.ACK.") or subject.startswith(self.root):
            return
        self.child.delivered |= self.workload.keys_in(msg.data or b"", msg.headers)


class Run:
    """One grading run's world; use `async with Run(...) as run`."""

    def __init__(self, grader: str, source: str, seed: int, *, ready_timeout: float = 6.0) -> None:
        self.grader = grader
        self.source = source
        self.public_seed = seed  # printed with the verdict, typed to replay it
        # What the grader draws its plan from: the seed under the plan key (nemesis.plan_seed), so the
        # public seed alone predicts nothing; never handed to learner processes.
        self.seed = nemesis.plan_seed(seed)
        self.ready_timeout = ready_timeout
        self.log = EffectLog()
        self.handlers: dict[str, EffectHandler] = {}
        self.planned: list[rules.Planned] = []  # planned faults other than crashes (rule 1 checks them too)
        self.workload = Workload()  # the keys of the messages published: where planned crashes land
        self.server: EmbeddedServer | None = None
        self.children: list[Child] = []
        self._spawns = itertools.count(1)  # numbers each spawn's inbox (spawns may start at once)
        self.tasks: list[asyncio.Task[Any]] = []
        self.nc: Any = None
        self.js: Any = None
        self.url = ""  # the grader's and course services' URL (full rights on the run's own server)
        self.learner_url = ""  # what learner processes get (restricted user on the run's own server)
        self.names = Names()
        self.t0 = time.time()
        self.sandbox = Sandbox.for_this_machine()
        self.tmp = ""
        self.home = ""
        self.inbox_prefix = ""  # on a shared server, the learner's inbox subjects (its slot's)
        self._slot_lock: int | None = None  # the lock file of this run's slot on a shared server
        self.zygote: Zygote | None = None

    async def __aenter__(self) -> Run:
        sweep_stale_runs()
        # In a folder nobody but the grader may list, so no run's name can be found by another's code.
        self.tmp = tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=runs_folder())
        os.chmod(self.tmp, 0o711)  # the learner's user may enter, not list
        try:
            self.home = os.path.join(self.tmp, "home")
            os.mkdir(self.home, 0o700)
            if self.sandbox.uid is not None:  # what the run writes here is bounded in all (else the zygote watches)
                bounded_home(self.home, self.sandbox.uid)
            self.sandbox.give(Path(self.home))
            if self.sandbox.uid is not None:
                protect_solutions(course_root())
            self.source = await asyncio.to_thread(self._copy_source, self.source)
            # The fork server imports Python's and nats' start-up cost once, while the broker starts.
            zygote = asyncio.ensure_future(Zygote(self.grader).start())
            try:
                await self._start_broker()
            finally:
                self.zygote = await zygote
        except BaseException:
            await self.__aexit__()  # a run that did not start leaves nothing either
            raise
        return self

    async def _start_broker(self) -> None:
        shared = os.environ.get("NATS_URL")
        if shared and admin_password_of(shared):
            # A shared server msglab started: this run takes a slot, whose user may touch only its names.
            slot = await asyncio.to_thread(self._take_slot, shared)
            # The slot's own account: its storage is bounded, and nothing of another run's is in sight.
            self.url, self.learner_url = slot_grader_url(shared, slot), slot_url(shared, slot)
            self.names = Names(slot_prefix(slot))
            self.inbox_prefix = f"_INBOX_{slot_prefix(slot)}"
        elif shared:
            # Any other shared server: names apart from everyone else's, but no user to enforce it.
            self.url = self.learner_url = shared
            self.names = Names("r" + secrets.token_hex(4))
        else:
            grader = importlib.import_module(self.grader)
            users = RunUsers(grader=grader)  # the lab's own streams, durables and subjects: nothing else is open
            config = os.path.join(self.tmp, "server.conf")
            fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the learner's user may not read it
            os.write(fd, users.config().encode())
            os.close(fd)
            self.server = await asyncio.to_thread(EmbeddedServer(config=config).start)
            self.url = users.grader_url(self.server.url)
            self.learner_url = users.learner_url(self.server.url)
        # A lab whose grader restarts the server (RECONNECTS, read by the runner too) lets connections ride it out.
        reconnects = reconnects_of(importlib.import_module(self.grader))
        quiet = {"error_cb": _quiet} if reconnects > 1 else {}  # a refused reconnect is expected, not news
        self.nc = await connect(
            self.url, name="msglab-grader", max_reconnect_attempts=reconnects, reconnect_time_wait=0.1, **quiet
        )
        # Where the learner's deliveries arrive, for a BrokerWatch started on this connection (observe.py).
        self.nc.msglab_inboxes = [self.inbox_prefix or (LEARNER_INBOX if self.server is not None else "_INBOX")]
        self.js = self.nc.jetstream()
        if self._slot_lock is not None:
            await delete_streams(self.js, self.names.stream(""))  # left by a run on this slot that was killed

    def _take_slot(self, url: str, wait: float = 30.0) -> int:
        """Lock a free slot of this shared server (one lock file per slot, per grading machine)."""
        import fcntl

        where = urlsplit(url.split(",")[0].strip())
        folder = Path(tempfile.gettempdir()) / f"msglab-slots-{where.hostname}-{where.port}"
        folder.mkdir(mode=0o700, exist_ok=True)
        deadline = time.monotonic() + wait
        while True:
            for slot in range(1, SLOTS + 1):
                fd = os.open(folder / f"{slot:02d}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._slot_lock = fd
                return slot
            if time.monotonic() > deadline:
                raise GraderError(
                    f"all {SLOTS} grading slots of {where.hostname}:{where.port} stayed busy for {wait:.0f} s"
                )
            time.sleep(0.1)

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._close()
        finally:  # even when the clean-up above is cancelled (Ctrl-C) or fails: nothing is left behind
            self._remove()

    async def _close(self) -> None:
        for child in self.children:
            child.kill_now("grader")
        # Whatever the learner's processes started, in their session or out of it, dies too: the
        # zygote kills all its descendants, the sweep every process of the run's user or tag.
        if self.zygote is not None:
            await self.zygote.stop()
        await asyncio.to_thread(self.sandbox.sweep)
        for child in self.children:
            await child.exited()
            if child.proc.stdin is not None:
                child.proc.stdin.close()
            if child._fx_writer is not None:
                child._fx_writer.close()
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)  # bounded: clean-up must never hang a verdict
        if self.names.prefix and self.js is not None:
            with contextlib.suppress(Exception):
                await delete_streams(self.js, self.names.stream(""))
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)

    def _remove(self) -> None:
        """What must go whatever happened: the server, the run's folder, the slot's lock (each once)."""
        for child in self.children:
            child.kill_now("grader")
        if self.server is not None:
            self.server.stop()  # at once when it is stopped already
        if self.tmp:
            remove_run_folder(self.tmp)
        if self._slot_lock is not None:
            with contextlib.suppress(OSError):
                os.close(self._slot_lock)  # releases the slot's lock
            self._slot_lock = None

    def abandon(self, remove: bool = False) -> None:
        """End this run from another thread while its event loop is stuck (grade.py's watchdog).

        Kills every learner process (the zygote too: its learners follow it), frees a grader blocked
        on a FIFO in the run's folder, stops the run's server; with `remove`, deletes the run's folder
        (when its own clean-up will not come). Safe to call more than once, and before the run started.
        """
        for child in list(self.children):
            child.kill_now("grader")
        zygote = self.zygote
        if zygote is not None and zygote.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(zygote.pid, signal.SIGKILL)  # its learner processes die with it (PDEATHSIG)
        self.sandbox.sweep()
        if self.tmp:
            release_blocked_readers(self.tmp)
        if self.server is not None:
            self.server.stop()
        if remove and self.tmp:
            remove_run_folder(self.tmp)

    def _copy_source(self, source: str) -> str:
        """Copy the graded file and its sibling modules into the run's folder; return the copy's path.

        The learner's processes run the copy: they never need the course tree, and a file
        changed during the run does not change what is graded.
        """
        original = Path(source)
        folder = Path(self.tmp) / "src"
        # Readable by the run's own user (its group, with a user of its own) and nobody else's: another
        # run's learner code cannot read this submission. Not writable by it: what is graded stays put.
        folder.mkdir(mode=0o700)
        uid = self.sandbox.uid
        # Read as learner-written files: a sibling that is a symlink (to a file only the grader may read),
        # a FIFO or a device is skipped, and nothing here can block the grader.
        for sibling in original.parent.glob("*.py"):
            if sibling != original:
                with contextlib.suppress(LearnerFileError):
                    (folder / sibling.name).write_bytes(read_learner_file(str(sibling), limit=SOURCE_LIMIT))
        try:
            (folder / original.name).write_bytes(read_learner_file(source, follow=True, limit=SOURCE_LIMIT))
        except LearnerFileError as exc:
            raise BrokenLearnerFile({"error": "NotARegularFile", "message": str(exc), "where": ""}) from None
        for path in [*folder.iterdir(), folder]:
            if uid is not None:
                os.chown(path, 0, uid)
            path.chmod(0o750 if path == folder else 0o640)
        return str(folder / original.name)

    @property
    def server_description(self) -> str:
        who = f"learner code as uid {self.sandbox.uid}" if self.sandbox.uid is not None else self.sandbox.why_not
        if self.server is not None:
            return f"fresh nats-server {self.server.version} ({self.server.binary.source}); {who}"
        where = self.learner_url.split("@")[-1]
        if self._slot_lock is None:
            return f"shared server {where} (names prefixed {self.names.prefix}, not enforced by the server); {who}"
        return f"shared server {where} (slot {self.names.prefix}, enforced by its user); {who}"

    def at(self, ts: float | None = None) -> str:
        """A grader timestamp as '+1.23s' since the run began, for traces."""
        return f"+{(time.time() if ts is None else ts) - self.t0:.2f}s"

    # --- effects ---------------------------------------------------------------------------

    def on(self, name: str, handler: EffectHandler) -> None:
        """Serve effect `name` with handler(child, key, detail, call_number); it records what it does.

        Without a handler an effect is recorded as it arrives and answered with None.
        """
        self.handlers[name] = handler

    def record_effect(self, child: Child, name: str, key: str | None, **detail: Any) -> Event:
        """Record an effect performed for `child`, with the grader's clock."""
        return self.log.record("effect", name, key, pid=child.pid, role=child.role, **detail)

    async def _effect(self, child: Child, message: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Handle one effect call: (answer?, reply). The nemesis may kill the child instead of answering."""
        name, key, detail = message["name"], message["key"], message["detail"]
        if child.all_calls >= MESSAGE_LIMIT:
            child._protocol_violation(f"it made more than {MESSAGE_LIMIT} effect calls")
            return False, {}
        child.all_calls += 1
        crash, call = None, 0  # call 0: a decoy, counted by no crash point
        why = "" if key is None else await self._holds(child, name, key)
        if self.workload.decoy(name, key):  # about no message of this run: never where a planned crash lands
            child.decoys.append((name, str(key)))
        elif why:  # about a message this process does not hold, or answered already: no kill lands there
            child.uncounted.append((name, str(key), why))
        else:
            if key is not None:
                child.counted.add((name, key))
            child.calls[name] += 1
            call = child.calls[name]
            due = [c for c in child.faults if (c.effect, c.call) == (name, call) and c not in child.fired]
            crash = due[0] if due else None
        if crash is not None and crash.when == "before":
            await self._crash(child, crash, key)
            return False, {}
        try:
            handler = self.handlers.get(name)
            if handler is None:
                self.record_effect(child, name, key, call=call, **detail)
                reply: dict[str, Any] = {"value": None}
            else:
                reply = {"value": await handler(child, key, detail, call)}
        except Refuse as refused:
            reply = {"raise": refused.error, "message": refused.message}
        if crash is not None:
            await self._crash(child, crash, key)
            return False, {}
        return True, reply

    async def _crash(self, child: Child, crash: Crash, key: str | None) -> None:
        child.fired.append(crash)
        self.log.record("crash", crash.effect, key, pid=child.pid, role=child.role, call=crash.call, when=crash.when)
        await child.kill("nemesis")

    async def _serve_effects(self, child: Child, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        child._fx_writer = writer
        while child.alive:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                child._protocol_violation(f"it wrote a line over {LINE_LIMIT} bytes to the effect channel")
                return
            except ConnectionError:
                return
            if not line:
                return
            try:
                message = json.loads(line)
                op, name, key = message["op"], message["name"], message.get("key")
                if not isinstance(message.get("detail", {}), dict):
                    raise TypeError("detail")
                message.setdefault("detail", {})
                # Names the log's own fields use: a learner's detail may not shadow them (nor raise in the grader).
                message["detail"] = {k: v for k, v in message["detail"].items() if k not in RESERVED_DETAIL}
                if op not in ("call", "note") or not isinstance(name, str) or len(name) > 100:
                    raise ValueError(op)
                if key is not None and not isinstance(key, str):
                    raise TypeError("key")
            except (ValueError, TypeError, KeyError, AttributeError):
                child._protocol_violation("it wrote something other than an effect request to the effect channel")
                return
            if op == "note":
                self.log.record("note", name, key, pid=child.pid, role=child.role, **message["detail"])
                continue
            answer, reply = await self._effect(child, message)
            if answer and child.alive:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    writer.write((json.dumps(reply, default=str) + "\n").encode())
                    await writer.drain()

    # --- children --------------------------------------------------------------------------

    async def spawn(
        self, role: str, *, faults: list[Crash] | None = None, params: dict[str, Any] | None = None
    ) -> Child:
        """Start learner code in a child process and wait until it says it is ready.

        Raises BrokenLearnerFile when the learner's file does not import.
        """
        env = dict(os.environ)
        root = self.learner_inbox()
        inbox = f"{root}.w{next(self._spawns)}" if root else ""  # this process's own (Workload.held)
        deliveries = await self._watch_deliveries(inbox) if inbox else None
        env.update(
            MSGLAB_GRADER=self.grader,
            MSGLAB_ROLE=role,
            MSGLAB_SOURCE=self.source,
            MSGLAB_RUN_ID=self.sandbox.run_id,
            NATS_URL=self.learner_url,
            MSGLAB_INBOX=inbox,
            HOME=self.home,
            TMPDIR=self.home,
            MSGLAB_PREFIX=self.names.prefix,
            MSGLAB_PARAMS=json.dumps(params or {}),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",  # never leave __pycache__ in the learner's folder
        )
        ca = trusted_ca(self.learner_url)
        if ca:  # a TLS room's CA, as the PEM itself: the learner's uid may not read the file it came from
            env["NATS_CA"] = ca
        for name in ("MSGLAB_ROOT", "MSGLAB_STATE_DIR"):
            env.pop(name, None)  # nothing that leads to the course's own files
        assert self.zygote is not None
        proc, grader_end = await self.zygote.spawn(env, self.home, self.sandbox.uid, LINE_LIMIT)
        child = Child(role, proc, faults=list(faults or []), inbox=inbox)
        if deliveries is not None:
            deliveries.child, child._deliveries = child, deliveries.sub
        child._ready = asyncio.get_running_loop().create_future()
        self.children.append(child)
        fx_reader, fx_writer = await asyncio.open_unix_connection(sock=grader_end, limit=LINE_LIMIT)
        self.tasks += [
            asyncio.ensure_future(self._read_stderr(child)),
            asyncio.ensure_future(self._read_protocol(child)),
            asyncio.ensure_future(self._serve_effects(child, fx_reader, fx_writer)),
        ]
        try:
            message = await asyncio.wait_for(asyncio.shield(child._ready), self.ready_timeout)
        except TimeoutError:
            message = {}
        if message.get("event") == "broken":
            await child.wait_exit(2.0)
            await child.kill()  # whatever its import started goes with it
            raise BrokenLearnerFile(message)
        if message.get("event") != "ready":
            # Said before the kill: a process the grader stops at its deadline did not end by itself.
            ended = (
                child.how_it_ended()
                if not child.alive
                else f"was not ready within {self.ready_timeout:.0f} s (the grader stopped it)"
            )
            await child.kill()
            raise BrokenLearnerFile({"error": "DidNotStart", "message": f"the {role} process {ended}", "where": ""})
        return child

    async def restart_broker(self) -> float:
        """Stop the run's own server and start it again (same config, store folder and port); return when it
        is back and the grader's connection with it. Streams and durables on file storage survive; processes
        ride it out only where the grader's RECONNECTS allows their connections to reconnect."""
        if self.server is None:
            raise GraderError("this lab restarts the server, which only a run's own server allows")
        started = time.time()
        await asyncio.to_thread(self.server.restart)
        await self.nc.flush(timeout=10)  # waits out the grader connection's reconnect
        return started

    def learner_inbox(self) -> str:
        """The learner's inbox subjects on this run's server (each process gets one below it), or ''
        on a shared server msglab did not start, where no user keeps the learner to an inbox."""
        return self.inbox_prefix or (LEARNER_INBOX if self.server is not None else "")

    async def _watch_deliveries(self, inbox: str) -> _Deliveries:
        """Take a copy of every message the server delivers to `inbox` (one process's): the keys of those a
        stream delivered (a reply subject of $JS.ACK, under a stream's subject, not a publish on the inbox)."""
        watch = _Deliveries(self.workload, self.learner_inbox() + ".")
        watch.sub = await self.nc.subscribe(f"{inbox}.>", cb=watch.on_message)
        await self.nc.flush()  # the server has the subscription before the process can fetch anything
        return watch

    async def _holds(self, child: Child, name: str, key: str) -> str:
        """Why this call about a message of the run counts toward no crash ('' if it counts)."""
        if name in self.workload.first_effects and (name, key) in child.counted:
            return "again"
        if name not in self.workload.held_effects or not child.inbox or key in child.delivered:
            return ""
        # The server sends the grader's copy as it sends the process's: wait for what it sent before now.
        with contextlib.suppress(Exception):
            await observe.caught_up(self.nc, [child._deliveries])
        return "" if key in child.delivered else "not held"

    async def _read_stderr(self, child: Child) -> None:
        """Drain the child's output in chunks (a flood must never block it or slow the grader); keep the tail."""
        assert child.proc.stderr is not None
        partial, total = b"", 0
        while chunk := await child.proc.stderr.read(1 << 16):
            total += len(chunk)
            child.flood = child.flood or total > FLOOD_BYTES
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()[: 4 * OUTPUT_LINE_CHARS]  # one endless line: keep its start
            child.output.extend(clean_line(line) for line in lines[-OUTPUT_LINES:])
        if partial:
            child.output.append(clean_line(partial))

    async def _read_protocol(self, child: Child) -> None:
        assert child.proc.stdout is not None and child._ready is not None
        count = 0
        try:
            while True:
                count += 1
                if count > MESSAGE_LIMIT:
                    child._protocol_violation(f"it sent more than {MESSAGE_LIMIT} messages on the grader's channel")
                    return
                try:
                    line = await child.proc.stdout.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    child._protocol_violation(f"it wrote a line over {LINE_LIMIT} bytes to the grader's channel")
                    return
                if not line:
                    return
                try:
                    message = json.loads(line)
                    if not isinstance(message, dict):
                        raise TypeError
                except (ValueError, TypeError):
                    child._protocol_violation("it wrote something other than the grader's protocol to its channel")
                    return
                event = message.get("event")
                if event in ("ready", "broken") and not child._ready.done():
                    child._ready.set_result(message)
                elif event == "died" and child.died is None:
                    child.died = {k: str(message.get(k, ""))[:4000] for k in ("error", "message", "where", "traceback")}
                elif event == "returned":
                    child.returned = True
                elif "id" in message:
                    await child._replies.put(message)
        finally:
            await child.exited()
            if not child._ready.done():
                child._ready.set_result({})
            await child._replies.put({})

    async def wait_for(
        self, condition: Callable[[], Awaitable[bool] | bool], timeout: float, interval: float = 0.01
    ) -> bool:
        """Wait until condition() holds, or timeout; True if it held.

        The state lives in another process (the broker, a child), so this polls it; a short
        interval keeps the verdict fast without betting on any fixed delay. A condition that asks
        the broker (a coroutine) is asked at most every ASK_INTERVAL: each question costs the
        server and the grader CPU, and a class graded at once pays it many times over.
        """
        deadline = time.monotonic() + timeout
        while True:
            answer = condition()
            asked = not isinstance(answer, bool)
            result = await answer if not isinstance(answer, bool) else answer
            if result:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(max(interval, ASK_INTERVAL) if asked else interval)

    # --- the checks every grader shares ----------------------------------------------------

    def faults_check(self) -> Check:
        """Rule 1 (msglab.grading.rules.faults_check) over this run's processes."""
        return rules.faults_check(self.children, self.planned)

    def deaths_check(self) -> Check:
        """Rule 3 (msglab.grading.rules.deaths_check) over this run's processes."""
        return rules.deaths_check(self.children)

    def workload_check(self, words: str = "effect") -> Check:
        """Effects name only things that exist: every effect call's key is a message this run published.

        A lab adopts it once it registers its keys (Workload); `words` names its effects in the lab's
        terms (e.g. "email"). Fails with the calls about no message, by process.
        """
        title = f"every {words} is about a message the run published"
        if self.workload.held_effects:
            title = f"every {words} is about a message the run published, made by the process it was delivered to"
        decoys = [(child, name, key) for child in self.children for name, key in child.decoys]
        unheld = [(c, name, key) for c in self.children for name, key, why in c.uncounted if why == "not held"]
        if self.workload.keys and not decoys and unheld:
            child, name, _ = unheld[0]
            keys = list(dict.fromkeys(key for c, _, key in unheld if c is child))
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            return Check(
                "effects_on_the_workload",
                title,
                False,
                f"your {child.role} process {child.pid} called {name} for {shown}, but the server never delivered "
                f"{'that message' if len(keys) == 1 else 'those messages'} to it ({rules.plural(len(unheld), 'call')} "
                "about messages a process did not receive, in all).",
                hint=f"make each {words} only about a message that process received from the server, after it came",
            )
        if not self.workload.keys or not decoys:
            return Check("effects_on_the_workload", title, True)
        child, name, _ = decoys[0]
        keys = list(dict.fromkeys(key for c, _, key in decoys if c is child))
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        return Check(
            "effects_on_the_workload",
            title,
            False,
            f"your {child.role} process {child.pid} called {name} for {shown}: no message of this run carries "
            f"{'that key' if len(keys) == 1 else 'those keys'} ({rules.plural(len(decoys), 'call')} about "
            "nothing in all).",
            hint=f"make each {words} about a message your worker received, with the key that message carries",
        )

    def output_tail(self) -> list[str]:
        """What the learner's processes printed, last lines, escapes removed."""
        lines: list[str] = []
        for child in self.children:
            lines += [f"[{child.role} {child.pid}] {line}" for line in child.output if line.strip()]
            if child.flood:
                lines.append(f"[{child.role} {child.pid}] ... printed more than {FLOOD_BYTES >> 20} MB")
        return lines[-12:]


RUNS_FOLDER = RUN_PREFIX + "folders"  # named like a run folder: a private /tmp shows the learner only that name
_runs_folder: list[str] = []  # this process's, once made or checked


async def _quiet(exc: Exception) -> None:
    """A connection's error callback that says nothing (the client's default prints a traceback)."""


def reconnects_of(grader: Any) -> int:
    """How often a connection of this lab retries a lost server (its grader's RECONNECTS; 1 by default, so a
    server that dies ends a run at once instead of leaving it waiting)."""
    return int(getattr(grader, "RECONNECTS", 1))


def runs_folder() -> str:
    """The folder every run folder of this user sits in: owned by the grader's user, mode 0711 (others
    may enter a run folder whose name they know, never list the names), in the temporary folder.

    Made once per user; one that exists but is not the grader's own safe folder (a symlink, another
    user's, writable by others: planted by someone) is not used: this process makes a fresh one.
    """
    if _runs_folder:
        return _runs_folder[0]
    path = os.path.join(tempfile.gettempdir(), f"{RUNS_FOLDER}-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o711)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        path = tempfile.mkdtemp(prefix=f"{RUNS_FOLDER}-{os.geteuid()}-")
    os.chmod(path, 0o711)
    _runs_folder.append(path)
    return path


def sweep_stale_runs(tmp: str | None = None) -> list[str]:
    """Remove run folders whose grader process is gone (a grader that was killed leaves them)."""
    removed = []
    # Where runs are made now, and the temporary folder itself, where they were made before runs_folder().
    where = [Path(tmp)] if tmp else [Path(runs_folder()), Path(tempfile.gettempdir())]
    for folder in (found for place in where for found in place.glob(RUN_PREFIX + "*")):
        pid = folder.name[len(RUN_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            remove_run_folder(str(folder))  # a killed grader's bounded home is still mounted there
            removed.append(str(folder))
    return removed


def release_blocked_readers(folder: str) -> int:
    """Open and close the other end of every FIFO under `folder`: a grader blocked opening or reading one
    (a learner put it where a file was) gets data or end-of-file instead of waiting forever. Returns how many."""
    released = 0
    for where, _folders, names in os.walk(folder):  # never follows a symlink out of the run's folder
        for name in names:
            path = os.path.join(where, name)
            with contextlib.suppress(OSError):
                if not stat.S_ISFIFO(os.lstat(path).st_mode):
                    continue
                for flags in (os.O_WRONLY, os.O_RDONLY):  # for a blocked reader, then for a blocked writer
                    with contextlib.suppress(OSError):  # ENXIO: nobody is waiting on this side
                        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
                        if flags == os.O_WRONLY:
                            with contextlib.suppress(OSError):
                                os.write(fd, b"\0" * 4096)  # not a database, not text: the reader gives up
                        os.close(fd)
                        released += 1
    return released
