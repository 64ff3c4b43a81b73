"""`msglab lab` (and `make lab`): JupyterLab on the course, with one NATS server for every notebook.

The server is started here, not in a kernel, and its address reaches every kernel through the
environment JupyterLab passes on (NATS_URL, read by msglab.broker), so all lessons share it.
JupyterLab runs as a child process (`python -m jupyterlab`): importing this module costs nothing.
On exit, whatever the reason, JupyterLab goes first (it shuts its kernels down), then the server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast
from urllib.parse import urlparse

from msglab.errors import MsglabError

DEFAULT_PORT = 8888
LESSONS = "lessons"
START_TIMEOUT = 120.0  # a first start on a cold, busy laptop can take a while
STOP_GRACE = 10.0  # JupyterLab shuts kernels down on SIGTERM; give it that long before SIGKILL
# Settings every learner gets as defaults (a learner's own choices still win). "fetchNews": "false" removes
# the "Would you like to get notified about official Jupyter news?" pop-up, which hides lesson cells.
OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}
_RUNNING = re.compile(r"is running at:")


class LabStartError(MsglabError):
    """JupyterLab did not start (its last log lines are quoted)."""


@dataclass
class LabProcess:
    """A running JupyterLab: its process, URL and log, and how to stop it."""

    proc: subprocess.Popen[str]
    port: int
    token: str
    log_path: Path | None = None
    output: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str = f"lab/tree/{LESSONS}") -> str:
        """The URL a browser opens: `path` under the server, with the token."""
        return f"{self.base_url}/{path.lstrip('/')}?token={self.token}"

    def stop(self) -> None:
        """SIGTERM (JupyterLab then stops its kernels), SIGKILL after STOP_GRACE seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on host:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free on host (JupyterLab binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def choose_port(wanted: int | None) -> int:
    """The port asked for (an error if taken), else 8888, else any free loopback port."""
    if wanted is not None:
        if not port_free(wanted):
            raise LabStartError(
                f"port {wanted} on 127.0.0.1 is already in use",
                hint="pick another with --port, or leave --port out to get a free one",
            )
        return wanted
    return DEFAULT_PORT if port_free(DEFAULT_PORT) else free_port()


def write_settings(folder: Path, extra: dict[str, dict[str, object]] | None = None) -> Path:
    """Write the course's JupyterLab settings defaults (overrides.json, plus `extra`) into folder; return it.

    JupyterLab reads overrides from its app settings folder; pointing it at this one (with
    --LabApp.app_settings_dir) leaves the installed JupyterLab untouched. Overrides already in the
    installed one are carried over, ours on top.
    """
    folder.mkdir(parents=True, exist_ok=True)
    merged: dict[str, dict[str, object]] = {}
    installed = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    if installed.is_file() and installed.resolve() != (folder / "overrides.json").resolve():
        try:
            merged = json.loads(installed.read_text())
        except (OSError, ValueError):
            merged = {}
    for plugin, values in [*OVERRIDES.items(), *(extra or {}).items()]:
        merged.setdefault(plugin, {}).update(values)
    (folder / "overrides.json").write_text(json.dumps(merged, indent=2) + "\n")
    return folder


def lab_command(*, port: int, token: str, root: Path, settings_dir: Path, open_browser: bool = False) -> list[str]:
    """The `python -m jupyterlab ...` command line `msglab lab` runs (tests run the same one)."""
    args = [
        sys.executable, "-m", "jupyterlab",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",  # the printed URL must be the one it listens on
        f"--ServerApp.root_dir={root}",
        f"--FileContentsManager.preferred_dir={LESSONS}",
        f"--IdentityProvider.token={token}",
        f"--LabApp.default_url=/lab/tree/{LESSONS}",
        f"--LabApp.app_settings_dir={settings_dir}",
        "--LabApp.news_url=None",  # no request to the news feed from the server side either
        "--ServerApp.open_browser=" + ("True" if open_browser else "False"),
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")  # containers and CI run as root; JupyterLab refuses without it
    return args


def lab_env(url: str, version: str | None, binary: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for JupyterLab and so for every kernel: which NATS server to use."""
    env = dict(os.environ if base is None else base)
    env["NATS_URL"] = url
    for key, value in (("MSGLAB_SERVER_VERSION", version), ("MSGLAB_SERVER_BINARY", binary)):
        if value:
            env[key] = value
        else:
            env.pop(key, None)  # a stale value from the user's shell would describe another server
    return env


def start_lab(
    command: list[str],
    env: dict[str, str],
    port: int,
    token: str,
    log_path: Path | None = None,
    timeout: float = START_TIMEOUT,
) -> LabProcess:
    """Start JupyterLab and return once it serves requests; raise LabStartError if it does not."""
    from msglab.broker.server import die_with_parent

    log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115 (the reader closes it)
    try:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # Own process group: Ctrl-C reaches us only, and we stop JupyterLab in order. It still dies with us.
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )  # fmt: skip
    except OSError as exc:
        if log:
            log.close()
        raise LabStartError(f"could not run {command[0]} -m jupyterlab: {exc}") from exc
    lab = LabProcess(proc, port, token, log_path)

    def read() -> None:
        # Drain JupyterLab's log for its whole life (a full pipe would stall it) into the log file.
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lab.output.append(line.rstrip("\n"))
                if log:
                    log.write(line)
                    log.flush()
                if _RUNNING.search(line):
                    lab.ready.set()
        finally:
            if log:
                log.close()
            lab.ready.set()  # EOF: it exited; wake the waiter so it can say why

    threading.Thread(target=read, name="jupyterlab-output", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        lab.ready.wait(timeout)
        # Jupyter Server logs "is running at" just before its event loop binds the port: wait until it answers.
        serving = lab.ready.is_set() and _wait_serving(lab, deadline)
    except BaseException:  # Ctrl-C while it starts: we hold the only handle on it, so stop it here
        lab.stop()
        raise
    if proc.poll() is not None or not serving:
        why = f"exited with code {proc.returncode}" if proc.poll() is not None else f"was not ready in {timeout:.0f} s"
        tail = "".join(f"\n    | {line}" for line in list(lab.output)[-15:])
        lab.stop()
        raise LabStartError(
            f"JupyterLab {why}; its last lines:{tail}", hint=f"the whole log is in {log_path}" if log_path else None
        )
    return lab


def _wait_serving(lab: LabProcess, deadline: float) -> bool:
    """True once JupyterLab answers /api/status; False if it exits or the deadline passes first."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    while time.monotonic() < deadline:
        try:
            with opener.open(lab.url("api/status"), timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        try:
            lab.proc.wait(0.05)  # between tries, and returns at once if it dies
            return False
        except subprocess.TimeoutExpired:
            pass
    return False


def has_display() -> bool:
    """Whether a browser window could open here (Linux without X or Wayland cannot)."""
    if sys.platform.startswith("linux") or sys.platform.startswith("freebsd"):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def _root() -> Path:
    from msglab.catalog import course_root

    return course_root()


def _nats_version(url: str, timeout: float = 2.0) -> str | None:
    """The version a NATS server announces in its INFO line, or None if nothing answers."""
    first = url.split(",")[0].strip()
    parsed = urlparse(first if "://" in first else f"nats://{first}")
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=timeout) as sock:
            line = sock.makefile("rb").readline(64 * 1024).decode("utf-8", "replace")
    except OSError:
        return None
    if not line.startswith("INFO "):
        return None
    try:
        return str(json.loads(line[5:]).get("version")) or None
    except ValueError:
        return None


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM / SIGHUP (terminal closed): clean up as for Ctrl-C


def run_lab(port: int | None, open_browser: bool) -> int:
    """Start the shared server (unless NATS_URL is set) and JupyterLab on the lessons; block until Ctrl-C."""
    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import start_shared_server

    root = _root()
    chosen = choose_port(port)
    server: EmbeddedServer | None = None
    lab: LabProcess | None = None
    stop_signals = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, _raise_on_signal) for sig in stop_signals}
    try:
        from msglab.classroom.join import joined_url

        user_url = os.environ.get("NATS_URL") or joined_url()  # a classroom account from `msglab join`
        if user_url:
            version = os.environ.get("MSGLAB_SERVER_VERSION") or _nats_version(user_url)
            binary = os.environ.get("MSGLAB_SERVER_BINARY")
            url, where = user_url, "from your NATS_URL; msglab started no server"
            if version is None:
                print(
                    f"msglab: warning: nothing answers at NATS_URL={user_url}; lessons will fail to connect",
                    file=sys.stderr,
                )
        else:
            # Users as on every shared server msglab starts: graders get a slot each (see msglab.broker.users).
            started, url = start_shared_server()
            server = cast(EmbeddedServer, started)
            version = server.version
            binary = f"{server.binary.source}: {server.binary.path}"
            where = f"started for this session, {binary}; its data is temporary"
        token = secrets.token_urlsafe(24)
        browser = open_browser and has_display()
        var = root / "var" / "jupyterlab"
        settings = write_settings(var / "settings")
        command = lab_command(port=chosen, token=token, root=root, settings_dir=settings, open_browser=browser)
        print(f"msglab: nats-server {version or '(version unknown)'} with JetStream at {url}", flush=True)
        print(f"        ({where})", flush=True)
        print("msglab: starting JupyterLab ...", flush=True)
        lab = start_lab(command, lab_env(url, version, binary), chosen, token, log_path=var / "jupyterlab.log")
        if browser:
            print("msglab: JupyterLab is running and opens in your browser; if it does not, open:", flush=True)
        else:
            print("msglab: JupyterLab is running; open this URL in your browser:", flush=True)
        print(f"\n    {lab.url()}\n")
        print(f"        every notebook uses the server above (NATS_URL={url}).")
        print(f"        JupyterLab's log: {lab.log_path}")
        print("        Ctrl-C stops JupyterLab and the server.", flush=True)
        code = lab.proc.wait()
        if code != 0:
            tail = "\n".join(f"    | {line}" for line in list(lab.output)[-10:])
            print(f"msglab: JupyterLab exited with code {code}; its last lines:\n{tail}", file=sys.stderr)
            return 2
        return 0
    except KeyboardInterrupt:
        print(f"\nmsglab: stopping JupyterLab{' and the server' if server else ''} ...", flush=True)
        return 0
    finally:
        # Ignore further Ctrl-C while tidying up: an impatient second press must not leave a server behind.
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if lab is not None:
                lab.stop()
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGINT, interrupt)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
