"""The child process that runs learner code for a grader: `python -m msglab.grading.runner`.

What it needs arrives in the environment (MSGLAB_GRADER, MSGLAB_ROLE, MSGLAB_SOURCE, NATS_URL,
MSGLAB_PREFIX, MSGLAB_PARAMS, MSGLAB_FX_FD). Two channels lead to the grader:
  - JSON lines on a private copy of the original stdout: ready, broken, died, returned, and the
    replies to service ops (commands arrive on stdin). The learner's prints go to stderr.
  - the effect channel (a socket on fd MSGLAB_FX_FD): `env.world.call(...)` sends one effect
    and blocks until the grader answers, without yielding to the event loop, so nothing the
    learner's code buffered (an ack, a publish) moves while the grader decides; the grader may
    SIGKILL the process instead of answering. Nothing here knows the fault plan.
A role is either `role_<name>(env, learner)`, a coroutine that runs until the grader kills it
(a worker), or `ops_<name>(env, learner)`, a dict of coroutines the grader calls one at a time
(a service).
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import importlib.util
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from msglab.broker import tls_options
from msglab.grading.labkit import LabEnv, Names

LEARNER_MODULE = "learner_lab"
TRACEBACK_LIMIT = 4000  # characters of a traceback sent to the grader


def load_learner(path: str) -> ModuleType:
    """Import the learner's file by path, with its folder importable (for sibling helpers)."""
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(LEARNER_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[LEARNER_MODULE] = module
    spec.loader.exec_module(module)
    return module


def where_in(exc: BaseException, path: str) -> str:
    """'orders.py:42 in place_order' for the innermost frame inside the learner's file."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
    if isinstance(exc, SyntaxError) and exc.filename == path:
        return f"{Path(path).name}:{exc.lineno}"
    if not frames:
        return ""
    last = frames[-1]
    return f"{Path(path).name}:{last.lineno} in {last.name}"


def describe(exc: BaseException, path: str) -> dict[str, Any]:
    """An exception as data the grader can judge and quote."""
    return {"error": type(exc).__name__, "message": str(exc)[:500], "where": where_in(exc, path)}


class Channel:
    """JSON lines to the grader, on a private copy of the original stdout."""

    def __init__(self) -> None:
        self.out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # from here on, fd 1 (and print) goes to stderr

    def send(self, **message: Any) -> None:
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()


class WorldError(Exception):
    """An effect the grader's world refused, when no more specific exception class is named."""


class World:
    """The learner's side of the effect channel: synchronous calls the grader answers (or kills)."""

    def __init__(self, fd: int, grader: ModuleType) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        self.grader = grader
        self._buffer = b""

    def _send(self, message: dict[str, Any]) -> None:
        self.sock.sendall((json.dumps(message, default=str) + "\n").encode())

    def call(self, name: str, key: Any = None, **detail: Any) -> Any:
        """Ask the grader's world to perform effect `name` for `key`; return its answer or raise its error."""
        self._send({"op": "call", "name": name, "key": None if key is None else str(key), "detail": detail})
        while b"\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the grader closed the effect channel")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if "raise" in reply:
            name = reply["raise"]
            cls = getattr(self.grader, name, None) or getattr(builtins, name, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = WorldError
            raise cls(reply.get("message", ""))
        return reply.get("value")

    def note(self, name: str, key: Any = None, **detail: Any) -> None:
        """Tell the grader something happened (one way; the grader does not answer)."""
        self._send({"op": "note", "name": name, "key": None if key is None else str(key), "detail": detail})


async def serve(ops: dict[str, Any], channel: Channel, path: str) -> None:
    """Run the grader's commands one at a time until stdin closes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        started = time.perf_counter()
        try:
            value = await ops[command["op"]](**command.get("args", {}))
            channel.send(id=command["id"], ok=True, value=value, elapsed=time.perf_counter() - started)
        except Exception as exc:  # the learner's failure is data for the grader
            channel.send(id=command["id"], ok=False, elapsed=time.perf_counter() - started, **describe(exc, path))


async def _quiet(exc: Exception) -> None:
    """An error callback that says nothing (nats-py's default prints a traceback per refused reconnect)."""


async def amain(channel: Channel) -> int:
    import nats

    path = os.environ["MSGLAB_SOURCE"]
    role = os.environ["MSGLAB_ROLE"]
    grader = importlib.import_module(os.environ["MSGLAB_GRADER"])
    world = World(int(os.environ["MSGLAB_FX_FD"]), grader)
    guard = getattr(grader, "before_learner", None)  # a lab's guards, in place before the learner's file runs
    if guard is not None:
        guard(role)
    try:
        learner = load_learner(path)
    except BaseException as exc:  # a broken file is a verdict, reported as data
        channel.send(event="broken", **describe(exc, path))
        return 3
    options: dict[str, Any] = {"inbox_prefix": os.environ["MSGLAB_INBOX"]} if os.environ.get("MSGLAB_INBOX") else {}
    url = os.environ["NATS_URL"]
    options |= tls_options(url)  # a TLS room: checked against NATS_CA
    reconnects = int(getattr(grader, "RECONNECTS", 1))  # harness.reconnects_of: a lab that restarts the server
    if reconnects > 1:  # a refused reconnect while the server restarts is expected: not the learner's output
        options["error_cb"] = _quiet
    nc = await nats.connect(
        url, name=f"msglab-{role}", max_reconnect_attempts=reconnects, reconnect_time_wait=0.1, **options
    )
    env = LabEnv(
        nc,
        nc.jetstream(),
        Names(os.environ.get("MSGLAB_PREFIX", "")),
        json.loads(os.environ.get("MSGLAB_PARAMS", "{}")),
    )
    env.world = world  # type: ignore[attr-defined]
    if hasattr(grader, f"ops_{role}"):
        ops = getattr(grader, f"ops_{role}")(env, learner)
        channel.send(event="ready", pid=os.getpid())
        await serve(ops, channel, path)
        return 0
    channel.send(event="ready", pid=os.getpid())
    try:
        await getattr(grader, f"role_{role}")(env, learner)
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))[-TRACEBACK_LIMIT:]
        channel.send(event="died", traceback=text, **describe(exc, path))
        traceback.print_exc()
        return 4
    channel.send(event="returned")
    return 0


def main() -> None:
    channel = Channel()
    code = asyncio.run(amain(channel))
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the grader is waiting


if __name__ == "__main__":
    main()
