"""Fork servers for grading runs: a nursery per grading process, a zygote per run.

Python's start-up and `import nats` cost most of a learner process's CPU, paid once per process.
So a grading process starts one nursery (`python -I`, in `/`, running `main` below), a fresh
interpreter that imports nats, the runner and each grader module once and holds no secret of the
grader's. For each run it forks a zygote; for each spawn the zygote forks a learner process, which
gets its pipes and effect socket over the run's control socket (SCM_RIGHTS), confines itself
(msglab.grading.sandbox) and runs msglab.grading.runner. A verdict thus costs two forks, not an
interpreter, and a class graded by one worker pays the imports once.

Every learner process is a fork of the nursery, so what the nursery holds, learner code can read:
its initial environment (/proc/<pid>/environ, set at exec), its `sys.path`, its imported modules.
Hence the nursery is started isolated (`-I`: no working directory or PYTHON* variables on the
path, no user site) with an allow-listed environment (`nursery_environment`), each spawn's
environment is allow-listed on the grader's side before it is sent (`learner_environment`), and
the learner process gets a `sys.path` of the standard library, site-packages and its run's source
folder only, and cannot import the course's graders, services, demos or classroom tools
(`sandbox.seal_course`).

The zygote is the run's container: for a sandbox user it takes a private scratch at its first spawn
(sandbox.private_scratch: its own bounded /tmp, /var/tmp, /dev/shm and System V IPC), and watches the
run's home where the kernel would not bound it (sandbox.written: past FOLDER_MB every process of the run
is stopped, reported as ended by SIGXFSZ); it is a child
subreaper, so every process the learner's code starts, even one that double-forks into a session of
its own, stays its descendant; when the grader shuts its side of the control socket (or dies), the
zygote SIGKILLs every descendant, reports the CPU the run's processes spent, and exits. The nursery
exits when its own socket closes, which the kernel does when the grading process ends, however it ends.

Nursery protocol (SOCK_SEQPACKET, one JSON message per packet):
  grader -> nursery  {"zygote": GRADER_MODULE} with 1 fd (the zygote's end of the run's control socket)
  nursery -> grader  {"pid": N} (or {"error": "..."})
Run protocol (the control socket):
  grader -> zygote   {"spawn": {"env": {...}, "cwd": "...", "uid": null|int}, "id": K} with 4 fds
                     (stdin read end, stdout write end, stderr write end, effect socket)
  zygote -> grader   {"pid": N, "id": K}         the process spawn K started
                     {"exit": N, "code": C}      a learner process ended (C < 0: killed by signal -C)
                     {"done": CPU}               the run is over: every descendant is dead and reaped
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import importlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Set
from pathlib import Path
from typing import Any

from msglab.grading.sandbox import (
    SCRATCH,
    WATCH_INTERVAL,
    Sandbox,
    learner_environment,
    learner_path,
    nursery_environment,
    over_bound,
    private_scratch,
    seal_course,
    written,
)

PR_SET_CHILD_SUBREAPER = 36
FX_FD = 3  # where a learner process finds its effect socket
ROOT = Path(__file__).resolve().parents[2]  # the folder holding the msglab package
# The nursery's start: msglab from site-packages (an installed or editable course), else from ROOT
# appended after the standard library and site-packages (so it can shadow none of them).
_BOOT = """import sys
try:
    import msglab
except ImportError:
    sys.path.append(sys.argv[2])
from msglab.grading.zygote import main
main()
"""


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


def _stop_descendants() -> None:
    """SIGKILL every descendant once; their ends are reported as they are reaped."""
    for pid in _descendants():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _past(watch: tuple[str, int | None, tuple[str, ...]] | None) -> bool:
    """Whether a watched run's folder is past its bound now."""
    return watch is not None and over_bound(*written(*watch))


def _reap(ctl: socket.socket | None, ours: set[int] | None = None, over: Set[int] = frozenset(),
          past: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
    """Collect every ended child; tell the grader about the ones it spawned (those the watch stopped for
    the folder's bound as ended by SIGXFSZ, the file size limit's own signal: limit_hit names it; so is one
    SIGKILLed while the folder is past its bound, before the watch looked: on a loaded machine the kernel
    can kill a writer that filled memory with the folder's pages first)."""
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
            if pid in over or (code == -signal.SIGKILL and past()):
                code = -signal.SIGXFSZ
            with contextlib.suppress(OSError):
                ctl.send(json.dumps({"exit": pid, "code": code}).encode())


def _become_learner(spec: dict[str, object], fds: list[int], ctl: socket.socket) -> None:
    """In the forked child: take the pipes, confine, and run the learner's role. Never returns."""
    from msglab.grading import runner

    try:
        os.setsid()
        ctl.close()  # first: its number may be one of 0-3, which the pipes are about to take
        # Lifted clear of 0-3 before placing: a received fd may already sit on a number another one needs.
        lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD, FX_FD + 1) for fd in fds]
        for target, fd in enumerate(lifted):  # stdin, stdout, stderr, effect socket -> 0, 1, 2, FX_FD
            os.dup2(fd, target)
        os.closerange(FX_FD + 1, 65536)  # nothing of the zygote's or another child's stays open
        env = learner_environment(dict(spec["env"]))  # type: ignore[call-overload]
        env["MSGLAB_FX_FD"] = str(FX_FD)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(str(spec["cwd"]))
        sys.path[:] = learner_path(os.path.dirname(env.get("MSGLAB_SOURCE", "")) or "/nonexistent")
        sys.path_importer_cache.clear()
        sys.dont_write_bytecode = True  # never a __pycache__ in the learner's folder
        # The runner imports its grader first, then the learner's file: the course's own code is
        # sealed in between (runner.main calls load_learner after resolving the grader's roles).
        load = runner.load_learner

        def sealed_load(path: str) -> Any:
            seal_course()
            return load(path)

        runner.load_learner = sealed_load
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
    try:
        runner.main()
    except BaseException:
        # Never let an exception climb into the zygote's or nursery's frames, which this fork shares.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _run_folder(spec: dict[str, Any]) -> str:
    """The folder holding the run's home (the spawn's cwd) and its copy of the learner's files."""
    env = spec.get("env") or {}
    return os.path.commonpath([str(spec["cwd"]), os.path.dirname(str(env.get("MSGLAB_SOURCE") or spec["cwd"]))])


def _zygote(ctl: socket.socket) -> None:
    """In a child of the nursery: serve one run's spawns until the grader shuts the control socket."""
    os.setsid()  # a session of its own: nothing sent to the grader's group reaches the run
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG: the zygote dies with the nursery
    if os.getppid() == 1:
        return  # the nursery is already gone
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ours: set[int] = set()
    scratch_done = False
    # A home the kernel would not bound (sandbox.bounded_home refused): what the run writes there (and, with
    # a user of its own but no private scratch, in the shared scratch folders) is looked at every
    # WATCH_INTERVAL; past the bound every process of the run is stopped, and so is any started later.
    watch: tuple[str, int | None, tuple[str, ...]] | None = None
    over: set[int] = set()
    next_look = 0.0
    try:
        while True:
            timeout = None if watch is None else max(0.0, next_look - time.monotonic())
            ready, _, _ = select.select([ctl.fileno(), wake_r], [], [], timeout)
            if watch is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + WATCH_INTERVAL
                if over_bound(*written(*watch)):
                    over |= ours
                    _stop_descendants()
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap(ctl, ours, over, functools.partial(_past, watch))
            if ctl.fileno() not in ready:
                continue
            try:
                data, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 4)
            except OSError:  # reset: the grader closed with our exit reports unread
                return
            if not data:
                return  # the grader ended the run (or died): end everything
            request = json.loads(data)
            spec = request["spawn"]
            if not scratch_done:  # the run's folder is known from its first spawn
                scratch_done = True
                uid = spec.get("uid") if isinstance(spec.get("uid"), int) else None
                bounded = os.path.ismount(str(spec["cwd"]))  # the run's home, a bounded tmpfs (bounded_home)
                # A sandbox user (a lesson's workers write the notebook's files) gets a private scratch.
                private = uid is not None and private_scratch(_run_folder(spec))
                if not bounded:
                    watch = (str(spec["cwd"]), uid, () if private or uid is None else SCRATCH)
            pid = os.fork()
            if pid == 0:
                if over:  # the run is past its folder's bound: a new process would only write more
                    os.kill(os.getpid(), signal.SIGKILL)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                _become_learner(spec, fds, ctl)
            ours.add(pid)
            if over:
                over.add(pid)
            for fd in fds:
                os.close(fd)
            try:
                ctl.send(json.dumps({"pid": pid, "id": request.get("id")}).encode())
            except OSError:
                return
    finally:
        _kill_all()
        _reap(ctl, ours, over)
        with contextlib.suppress(OSError):
            ctl.send(json.dumps({"done": _cpu()}).encode())


def _cpu() -> float:
    """CPU seconds of this process and every descendant it reaped."""
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    """The nursery: fork a zygote for each run asked for, until the grading process closes the socket."""
    nursery = socket.socket(fileno=int(sys.argv[1]))
    import nats  # noqa: F401  (imported once here, shared by every fork)

    import msglab.grading.runner  # noqa: F401

    signal.signal(signal.SIGCHLD, lambda *_: _reap(None))  # zygotes end on their own; collect them
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(nursery, 65536, 1)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return  # the grading process is gone
        try:
            importlib.import_module(json.loads(data)["zygote"])  # once per grader: every later fork has it
            pid = os.fork()
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            nursery.send(json.dumps({"error": repr(exc)}).encode())
            continue
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            nursery.close()
            try:
                _zygote(socket.socket(fileno=fds[0]))
            finally:
                os._exit(0)
        os.close(fds[0])
        try:
            nursery.send(json.dumps({"pid": pid}).encode())
        except OSError:
            return


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


class Nursery:
    """The grading process's handle on its nursery (see the module docstring): one per process, shared by threads."""

    _lock = threading.Lock()
    _current: Nursery | None = None

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # No PDEATHSIG: it would fire when the thread that started the nursery ends. The socket's
            # end, closed by the kernel with this process, is what ends the nursery.
            # Isolated (-I), in /, with an allow-listed environment: nothing the grader's working
            # directory or environment holds reaches the nursery, whose memory every learner inherits.
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, str(theirs.fileno()), str(ROOT)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True,
                cwd="/", env=nursery_environment(),
            )  # fmt: skip
        finally:
            theirs.close()
        self.sock = ours

    @classmethod
    def fork_zygote(cls, grader: str, control: int) -> int:
        """A new zygote for one run, serving `control`; its pid. A nursery that died is replaced once."""
        with cls._lock:
            for _attempt in (1, 2):
                if cls._current is None or cls._current.proc.poll() is not None:
                    cls._current = Nursery()
                try:
                    socket.send_fds(cls._current.sock, [json.dumps({"zygote": grader}).encode()], [control])
                    answer = cls._current.sock.recv(65536)
                    if answer:
                        reply = json.loads(answer)
                        if "pid" in reply:
                            return int(reply["pid"])
                        raise RuntimeError(f"the nursery could not start a run: {reply.get('error')}")
                except OSError:
                    pass
                cls._current.close()  # gone or broken: a fresh one next time round
                cls._current = None
            raise RuntimeError("the grading fork server did not start")

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @classmethod
    def shutdown(cls) -> None:
        """End the nursery (at exit: so its CPU is counted in this process's children)."""
        with cls._lock:
            if cls._current is not None:
                cls._current.close()
                cls._current = None


atexit.register(Nursery.shutdown)

_forked = [0.0]  # CPU of every finished run's zygote and learner processes (reaped by the nursery, not us)


def forked_cpu() -> float:
    """CPU seconds spent by the runs' zygotes and learner processes this process has finished so far."""
    return _forked[0]


class Zygote:
    """The grader's handle on its run's fork server."""

    def __init__(self, grader: str) -> None:
        self.grader = grader
        self.pid: int | None = None
        self.sock: socket.socket | None = None
        self.processes: dict[int, LearnerProcess] = {}
        self.cpu: float | None = None  # reported by the zygote when the run is over
        # Each spawn waits for its own answer: a shared queue of pids handed one spawn's pid to
        # another when two were in flight (a waiter woken but not yet running lost it to a newcomer).
        self._spawns: dict[int, Any] = {}  # spawn id -> asyncio.Future of its pid
        self._next_spawn = 0
        self._reader: Any = None

    async def start(self) -> Zygote:
        import asyncio

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.pid = await asyncio.to_thread(Nursery.fork_zygote, self.grader, theirs.fileno())
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
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
                waiting = self._spawns.pop(message.get("id"), None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(int(message["pid"]))
            elif "exit" in message and message["exit"] in self.processes:
                self.processes[message["exit"]].returncode = int(message["code"])
            elif "done" in message:
                self.cpu = float(message["done"])
                _forked[0] += self.cpu
        for process in self.processes.values():  # the zygote is gone, and every learner process with it
            if process.returncode is None:
                process.returncode = -signal.SIGKILL
        for waiting in self._spawns.values():
            if not waiting.done():
                waiting.set_result(0)
        self._spawns.clear()

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
        self._next_spawn += 1
        answer = self._spawns[self._next_spawn] = loop.create_future()
        if self._reader is None or self._reader.done():
            answer.set_result(0)  # the zygote is gone: nobody would answer
        try:
            # Allow-listed here, so the grader's other variables never reach the zygote's memory either.
            spawn = {"env": learner_environment(env), "cwd": cwd, "uid": uid}
            message = json.dumps({"spawn": spawn, "id": self._next_spawn}).encode()
            socket.send_fds(self.sock, [message], child_fds)
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
            child_end.close()
        pid = await answer
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
        """End the run: the zygote kills every descendant, reports their CPU and exits; wait for that."""
        import asyncio

        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
            if self._reader is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._reader), 5)
                except TimeoutError:
                    self._reader.cancel()
                    if self.pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self.pid, signal.SIGKILL)  # its learners follow it (PDEATHSIG, subreaper gone)
            self.sock.close()
            self.sock = None
        for process in self.processes.values():
            if process.returncode is None:
                process.returncode = -signal.SIGKILL
