"""The grader's side of a run: an isolated broker, an effect store, and learner processes.

A `Run` owns everything one grading run creates and removes all of it on exit: its own fresh
nats-server (or, when NATS_URL names a shared one, names prefixed with a random run id), a temp
folder with the effect store, and every child process it spawned.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .broker import connect, delete_streams
from .effects import EffectLog
from .labkit import Names
from .nemesis import Crash, encode
from .server import EmbeddedServer, die_with_parent


class BrokenLearnerFile(Exception):
    """The learner's file did not import; grading turns this into a failing verdict, not an error."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info
        super().__init__(f"{info.get('error')}: {info.get('message')}")


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
    gone: bool = False  # the child was already dead

    def describe(self) -> str:
        if self.hung:
            return f"did not return within {self.elapsed:.1f} s (the grader stopped it)"
        if self.gone:
            return "could not be called: the process had already died"
        if self.ok:
            return f"returned {self.value!r} after {self.elapsed:.3f} s"
        where = f" at {self.where}" if self.where else ""
        return f"raised {self.error}({self.message}){where} after {self.elapsed:.3f} s"


@dataclass
class Child:
    """One learner process: a worker the grader can kill, or a service it calls."""

    role: str
    proc: asyncio.subprocess.Process
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=50))
    broken: dict[str, Any] | None = None  # set when the learner's file did not import
    died: dict[str, Any] | None = None  # set when a worker role raised
    _next_id: int = 0
    _drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.output.append(line.decode(errors="replace").rstrip())

    async def _message(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            return None
        return json.loads(line) if line else {}

    async def call(self, op: str, timeout: float, **args: Any) -> Reply:
        """Ask a service child to run op; kill it if it does not answer within timeout."""
        if not self.alive:
            return Reply(ok=False, elapsed=0.0, gone=True)
        assert self.proc.stdin is not None
        self._next_id += 1
        started = time.perf_counter()
        self.proc.stdin.write((json.dumps({"id": self._next_id, "op": op, "args": args}) + "\n").encode())
        await self.proc.stdin.drain()
        message = await self._message(timeout)
        if message is None:
            await self.kill()
            return Reply(ok=False, elapsed=time.perf_counter() - started, hung=True)
        if not message:
            return Reply(ok=False, elapsed=time.perf_counter() - started, gone=True)
        message.pop("id", None)
        return Reply(**message)

    async def kill(self) -> None:
        """SIGKILL, as a crash would: no cleanup runs in the child."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def wait_exit(self, timeout: float) -> bool:
        """Wait for the process to end by itself; False if it is still running at the deadline."""
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def watch_events(self) -> None:
        """For workers: record 'died' (learner code raised) once the process says so."""
        while True:
            message = await self._message(3600)
            if not message:
                return
            if message.get("event") == "died":
                self.died = message


class Run:
    """One grading run's world; use `async with Run(...) as run`."""

    def __init__(self, grader: str, source: str, seed: int, *, ready_timeout: float = 15.0) -> None:
        self.grader = grader
        self.source = source
        self.seed = seed
        self.ready_timeout = ready_timeout
        self.tmp = tempfile.mkdtemp(prefix="msglab-run-")
        self.store = os.path.join(self.tmp, "effects.sqlite")
        self.log = EffectLog(self.store, "grader")
        self.server: EmbeddedServer | None = None
        self.children: list[Child] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.nc: Any = None
        self.js: Any = None
        self.url = ""
        self.names = Names()

    async def __aenter__(self) -> Run:
        shared = os.environ.get("NATS_URL")
        if shared:
            # A shared server: keep this run's streams and subjects apart from everyone else's.
            self.url = shared
            self.names = Names("r" + secrets.token_hex(4))
        else:
            self.server = EmbeddedServer().start()
            self.url = self.server.url
        self.nc = await connect(self.url, name="msglab-grader", max_reconnect_attempts=1, reconnect_time_wait=0.1)
        self.js = self.nc.jetstream()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        for child in self.children:
            await child.kill()
            if child.proc.stdin is not None:
                child.proc.stdin.close()
        if self.names.prefix and self.js is not None:
            await delete_streams(self.js, self.names.stream(""))
        if self.nc is not None:
            await self.nc.close()
        if self.server is not None:
            self.server.stop()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def server_description(self) -> str:
        if self.server is not None:
            return f"fresh nats-server {self.server.version} ({self.server.binary.source})"
        return f"shared server {self.url} (names prefixed {self.names.prefix})"

    async def spawn(
        self, role: str, *, faults: list[Crash] | None = None, params: dict[str, Any] | None = None
    ) -> Child:
        """Start learner code in a child process and wait until it says it is ready.

        Raises BrokenLearnerFile when the learner's file does not import.
        """
        env = dict(os.environ)
        env.update(
            MSGLAB_GRADER=self.grader,
            MSGLAB_ROLE=role,
            MSGLAB_SOURCE=self.source,
            NATS_URL=self.url,
            MSGLAB_PREFIX=self.names.prefix,
            MSGLAB_STORE=self.store,
            MSGLAB_FAULTS=encode(faults or []),
            MSGLAB_PARAMS=json.dumps(params or {}),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",  # never leave __pycache__ in the learner's folder
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "msglab.runner",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env, limit=1 << 20,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )  # fmt: skip
        child = Child(role, proc)
        self.children.append(child)
        child._drain = asyncio.ensure_future(child._read_stderr())
        self.tasks.append(child._drain)
        message = await child._message(self.ready_timeout)
        if message is None or not message:
            await child.kill()
            tail = "\n".join(child.output)
            raise RuntimeError(f"the {role} process did not start: {tail}")
        if message.get("event") == "broken":
            child.broken = message
            await child.proc.wait()
            raise BrokenLearnerFile(message)
        if message.get("event") == "ready" and role_is_worker(self.grader, role):
            self.tasks.append(asyncio.ensure_future(child.watch_events()))
        return child

    async def wait_for(
        self, condition: Callable[[], Awaitable[bool] | bool], timeout: float, interval: float = 0.01
    ) -> bool:
        """Wait until condition() holds, or timeout; True if it held.

        The state lives in another process (the broker, the effect store), so this polls it; a
        short interval keeps the verdict fast without betting on any fixed delay.
        """
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if not isinstance(result, bool):
                result = await result
            if result:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval)

    def output_tail(self) -> list[str]:
        """What the learner's processes printed, last lines (noise from Python itself removed)."""
        lines: list[str] = []
        for child in self.children:
            lines += [f"[{child.role} {child.pid}] {line}" for line in child.output if line.strip()]
        return lines[-12:]


def role_is_worker(grader: str, role: str) -> bool:
    import importlib

    return hasattr(importlib.import_module(grader), f"role_{role}")
