"""A lesson's worker in a real process: `python -m <module> <config json>`, killed for real.

    proc = await DemoProcess.spawn("msglab.demos.partition_keys", config)   # returns once it says "ready"
    await proc.say({"durable": "p0"}); await proc.expect("ok")
    proc.kill()        # SIGKILL to its process group: no ack, no cleanup
    await proc.close() # kill and reap

The process runs in its own session (so a kill takes its children too) and gets SIGKILL when the
kernel that started it dies, so a crashed notebook never leaves a worker pulling from a durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any


class DemoProcess:
    """One demo process and its stdin/stdout lines."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @classmethod
    async def spawn(cls, module: str, config: dict[str, Any], ready: str = "ready", timeout: float = 30) -> Any:
        """Start `python -m module json(config)`; return once its first line is `ready`."""
        from msglab.broker.server import die_with_parent

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        made = cls(proc)
        await made.expect(ready, timeout)
        return made

    async def say(self, command: dict[str, Any]) -> None:
        """Send one JSON line to the process."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, expected: str, timeout: float = 10) -> None:
        """Read one line; anything but `expected` (or nothing in `timeout` s) kills it and raises."""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            self.kill()
            raise RuntimeError(f"{self!r} said nothing in {timeout:g} s, not {expected!r}") from None
        if line.strip() != expected.encode():
            self.kill()
            raise RuntimeError(f"{self!r} said {line!r}, not {expected!r}")

    def kill(self) -> None:
        """SIGKILL to its process group: what it held unacked comes back after ack_wait."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Kill it and reap it."""
        self.kill()
        await self.proc.wait()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid {self.proc.pid}>"
