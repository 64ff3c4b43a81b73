"""A fork server for one grading run: `python -m msglab.grading.zygote GRADER CONTROL_FD`.

Python's start-up and `import nats` cost most of a learner process's CPU, paid once per process.
The run starts one zygote instead, which imports them (and the lab's grader module) once and
forks a learner process for each spawn: it gets its pipes and effect socket over the control
socket (SCM_RIGHTS), confines itself (msglab.grading.sandbox) and runs msglab.grading.runner.

The zygote is also the run's container: it is a child subreaper, so every process the learner's
code starts, even one that double-forks into a session of its own, stays its descendant; when the
grader closes the control socket (or dies), the zygote SIGKILLs every descendant, then exits.

Control protocol (a SOCK_SEQPACKET socket pair: one JSON message per packet, fds alongside):
  grader -> zygote  {"spawn": {"env": {...}, "cwd": "...", "uid": null|int}} with 4 fds
                    (stdin read end, stdout write end, stderr write end, effect socket)
  zygote -> grader  {"pid": N}                  the new process, in spawn order
                    {"exit": N, "code": C}      a learner process ended (C < 0: killed by signal -C)
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import random
import select
import signal
import socket
import sys
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
FX_FD = 3  # where a learner process finds its effect socket


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _descendants() -> list[int]:
    """Every process whose parent is this zygote (with the subreaper, that is every orphan too)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _kill_all() -> None:
    """SIGKILL every descendant until none is left (killing one may orphan more onto us)."""
    for _ in range(50):
        pids = _descendants()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(None)


def _reap(ctl: socket.socket | None, ours: set[int] | None = None) -> None:
    """Collect every ended child; tell the grader about the ones it spawned."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if ctl is not None and ours is not None and pid in ours:
            ours.discard(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(OSError):
                ctl.send(json.dumps({"exit": pid, "code": code}).encode())


def _become_learner(spec: dict[str, object], fds: list[int], ctl: socket.socket) -> None:
    """In the forked child: take the pipes, confine, and run the learner's role. Never returns."""
    from msglab.grading import runner
    from msglab.grading.sandbox import Sandbox

    try:
        os.setsid()
        stdin, stdout, stderr, fx = fds
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.dup2(fx, FX_FD)
        ctl.close()
        os.closerange(FX_FD + 1, 65536)  # nothing of the zygote's or another child's stays open
        env = dict(spec["env"])  # type: ignore[call-overload]
        env["MSGLAB_FX_FD"] = str(FX_FD)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(str(spec["cwd"]))
        uid = spec.get("uid")
        Sandbox(run_id=str(env.get("MSGLAB_RUN_ID", "")), uid=uid if isinstance(uid, int) else None).preexec()
        random.seed()  # a fork copies the random state; every process must draw its own
        sys.stdin = os.fdopen(0, "r")
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            os.write(2, f"msglab zygote: could not start the learner process: {exc!r}\n".encode())
        os._exit(70)
    runner.main()
    os._exit(0)


def main() -> None:
    grader, control = sys.argv[1], int(sys.argv[2])
    import nats  # noqa: F401  (imported once here, shared by every fork)

    import msglab.grading.runner  # noqa: F401

    importlib.import_module(grader)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG: the zygote dies with its grader
    if os.getppid() == 1:
        return  # the grader is already gone
    ctl = socket.socket(fileno=control)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ours: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([ctl.fileno(), wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap(ctl, ours)
            if ctl.fileno() not in ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 4)
            except OSError:  # reset: the grader closed with our exit reports unread
                return
            if not data:
                return  # the grader closed the run (or died): end everything
            spec = json.loads(data)["spawn"]
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                _become_learner(spec, fds, ctl)
            ours.add(pid)
            for fd in fds:
                os.close(fd)
            try:
                ctl.send(json.dumps({"pid": pid}).encode())
            except OSError:
                return
    finally:
        _kill_all()


if __name__ == "__main__":
    main()


# --- the grader's side ---------------------------------------------------------------------------


class LearnerProcess:
    """A learner process forked by the zygote, with the parts of asyncio's Process the harness uses."""

    def __init__(self, pid: int, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = stdin  # asyncio.StreamWriter
        self.stdout = stdout  # asyncio.StreamReader
        self.stderr = stderr  # asyncio.StreamReader

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def gone(self) -> bool:
        """The process has exited (a zombie counts), whether or not the zygote reported it yet."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return True

    async def wait(self) -> int:
        """Wait until the zygote reports this process's end; return its exit code (negative: signal)."""
        import asyncio

        while self.returncode is None:  # noqa: ASYNC110 (set by the zygote's exit report)
            await asyncio.sleep(0.005)
        return self.returncode


class Zygote:
    """The grader's handle on its run's fork server."""

    def __init__(self, grader: str) -> None:
        self.grader = grader
        self.proc: Any = None
        self.sock: socket.socket | None = None
        self.processes: dict[int, LearnerProcess] = {}
        self._pids: Any = None  # asyncio.Queue of spawned pids, in order
        self._reader: Any = None

    async def start(self) -> Zygote:
        import asyncio

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "msglab.grading.zygote", self.grader, str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self._pids = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())
        return self

    async def _read(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        assert self.sock is not None
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                break
            message = json.loads(data)
            if "pid" in message:
                await self._pids.put(message["pid"])
            elif "exit" in message and message["exit"] in self.processes:
                self.processes[message["exit"]].returncode = int(message["code"])
        for process in self.processes.values():  # the zygote is gone, and every learner process with it
            if process.returncode is None:
                process.returncode = -signal.SIGKILL
        await self._pids.put(0)

    async def spawn(self, env: dict[str, str], cwd: str, uid: int | None, limit: int) -> tuple[LearnerProcess, Any]:
        """Fork a learner process; return it and the grader's end of its effect socket."""
        import asyncio

        loop = asyncio.get_running_loop()
        assert self.sock is not None
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        grader_end, child_end = socket.socketpair()
        child_fds = [stdin_r, stdout_w, stderr_w, child_end.fileno()]
        try:
            message = json.dumps({"spawn": {"env": env, "cwd": cwd, "uid": uid}}).encode()
            socket.send_fds(self.sock, [message], child_fds)
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
            child_end.close()
        pid = await self._pids.get()
        if not pid:
            raise RuntimeError("the run's fork server is gone")
        stdout = asyncio.StreamReader(limit=limit)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(stdout_r, "rb", 0))
        stderr = asyncio.StreamReader(limit=limit)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr), os.fdopen(stderr_r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.streams.FlowControlMixin(), os.fdopen(stdin_w, "wb", 0)
        )
        stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        process = LearnerProcess(pid, stdin, stdout, stderr)
        self.processes[pid] = process
        return process, grader_end

    async def stop(self) -> None:
        """Close the control socket: the zygote kills every descendant and exits."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self._reader is not None:
            self._reader.cancel()
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio_wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for process in self.processes.values():
            if process.returncode is None:
                process.returncode = -signal.SIGKILL


async def asyncio_wait_for(awaitable: Any, timeout: float) -> Any:
    import asyncio

    return await asyncio.wait_for(awaitable, timeout)
