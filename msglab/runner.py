"""The child process that runs learner code for a grader: `python -m msglab.runner`.

Everything it needs arrives in the environment (MSGLAB_GRADER, MSGLAB_ROLE, MSGLAB_SOURCE,
NATS_URL, MSGLAB_PREFIX, MSGLAB_STORE, MSGLAB_FAULTS, MSGLAB_PARAMS). It talks to the grader
in JSON lines on its original stdout; the learner's own prints go to stderr, so a stray print
can never corrupt the protocol. A role is either `role_<name>(env, learner)`, a coroutine that
runs until the grader kills it (a worker), or `ops_<name>(env, learner)`, a dict of coroutines
the grader calls one at a time (a service).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from .effects import EffectLog
from .labkit import LabEnv, Names
from .nemesis import Nemesis

LEARNER_MODULE = "learner_lab"


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
    return {"error": type(exc).__name__, "message": str(exc), "where": where_in(exc, path)}


class Channel:
    """JSON lines to the grader, on a private copy of the original stdout."""

    def __init__(self) -> None:
        self.out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # from here on, fd 1 (and print) goes to stderr

    def send(self, **message: Any) -> None:
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()


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


async def amain(channel: Channel) -> int:
    import nats

    path = os.environ["MSGLAB_SOURCE"]
    role = os.environ["MSGLAB_ROLE"]
    grader = importlib.import_module(os.environ["MSGLAB_GRADER"])
    try:
        learner = load_learner(path)
    except BaseException as exc:  # a broken file is a verdict, reported as data
        channel.send(event="broken", **describe(exc, path))
        return 3
    nc = await nats.connect(
        os.environ["NATS_URL"], name=f"msglab-{role}", max_reconnect_attempts=1, reconnect_time_wait=0.1
    )
    log = EffectLog(os.environ["MSGLAB_STORE"], role)
    env = LabEnv(
        nc,
        nc.jetstream(),
        Names(os.environ.get("MSGLAB_PREFIX", "")),
        json.loads(os.environ.get("MSGLAB_PARAMS", "{}")),
    )
    env.log = log  # type: ignore[attr-defined]
    env.nemesis = Nemesis.from_env(log)  # type: ignore[attr-defined]
    if hasattr(grader, f"ops_{role}"):
        ops = getattr(grader, f"ops_{role}")(env, learner)
        channel.send(event="ready", pid=os.getpid())
        await serve(ops, channel, path)
        return 0
    channel.send(event="ready", pid=os.getpid())
    try:
        await getattr(grader, f"role_{role}")(env, learner)
    except Exception as exc:
        channel.send(event="died", **describe(exc, path))
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
