"""`msglab lab` (what `make lab` runs), end to end: the URL it prints works, every kernel would get the
course's server, and stopping it leaves nothing running. Real JupyterLab, real nats-server."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from msglab.broker.server import EmbeddedServer
from msglab.jupyter import LabStartError, choose_port, free_port

ROOT = Path(__file__).resolve().parent.parent
URL_LINE = re.compile(r"http://127\.0\.0\.1:(\d+)/lab/tree/lessons\?token=(\S+)")
NATS_LINE = re.compile(r"nats-server (\S+) with JetStream at (\S+)")
WAIT = 120.0  # seconds for JupyterLab to come up on a busy machine


@dataclass
class Lab:
    """A running `msglab lab` and what it printed."""

    proc: subprocess.Popen[str]
    runtime: Path
    lines: list[str] = field(default_factory=list)
    port: int = 0
    token: str = ""

    def get(self, path: str, method: str = "GET") -> dict:
        """Call JupyterLab's REST API with the printed token."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}?token={self.token}", method=method)
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.loads(resp.read())

    def jupyter_pid(self) -> int:
        (info,) = self.runtime.glob("jpserver-*.json")  # JupyterLab's own record of itself
        return int(json.loads(info.read_text())["pid"])


@pytest.fixture
def start_lab(tmp_path: Path) -> Iterator:
    """Start `python -m msglab lab --no-browser` with throwaway Jupyter folders; read until it prints its URL."""
    started: list[Lab] = []

    def start(extra_env: dict[str, str] | None = None) -> Lab:
        env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DISPLAY", "WAYLAND_DISPLAY")}
        for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTERLAB_SETTINGS_DIR",
                    "JUPYTERLAB_WORKSPACES_DIR"):  # fmt: skip
            (tmp_path / var).mkdir()
            env[var] = str(tmp_path / var)
        env.update(extra_env or {})
        proc = subprocess.Popen(
            [sys.executable, "-m", "msglab", "lab", "--no-browser", "--port", str(free_port())],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lab = Lab(proc, tmp_path / "JUPYTER_RUNTIME_DIR")
        started.append(lab)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            line = lines.get(timeout=WAIT)
            assert line is not None, "msglab lab exited before printing its URL:\n" + "\n".join(lab.lines)
            lab.lines.append(line)
            if m := URL_LINE.search(line):
                lab.port, lab.token = int(m.group(1)), m.group(2)
                return lab

    yield start
    for lab in started:  # a failed test must not leave JupyterLab behind either
        if lab.proc.poll() is None:
            lab.proc.kill()
            lab.proc.wait()


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kernel_pid(kernel_id: str) -> int | None:
    """The process running kernel `kernel_id` (its command line names its connection file), where /proc exists."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"kernel-{kernel_id}.json" in cmdline.read_text():
                return int(cmdline.parent.name)
        except OSError:
            continue
    return None


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_lab_serves_the_course_with_its_own_server_and_cleans_up(start_lab) -> None:
    """The printed URL works, JupyterLab's environment names the started server, Ctrl-C stops both."""
    lab = start_lab()
    printed = "\n".join(lab.lines)
    said = NATS_LINE.search(printed)
    assert said, printed
    version, nats_url = said.groups()
    parts = urlsplit(nats_url)
    host, nats_port = parts.hostname or "", str(parts.port)
    assert parts.username == "admin", "the course's server gives graders slots only through the admin's URL"
    assert lab.get("/api/status")["started"]
    # The course's settings defaults are served: no "Jupyter news" pop-up.
    notification = lab.get("/lab/api/settings/@jupyterlab/apputils-extension:notification")
    assert notification["schema"]["properties"]["fetchNews"]["default"] == "false"
    pid = lab.jupyter_pid()
    if Path("/proc").is_dir():
        env = _environ(pid)  # what every kernel inherits
        assert env["NATS_URL"] == nats_url
        assert env["MSGLAB_SERVER_VERSION"] == version
        assert "nats-server" in env["MSGLAB_SERVER_BINARY"]
        if os.geteuid() == 0:
            assert "--allow-root" in Path(f"/proc/{pid}/cmdline").read_text()
    assert _answers(host, int(nats_port))
    kernel = _kernel_pid(lab.get("/api/kernels", method="POST")["id"])  # a notebook's kernel, as a learner opens one
    assert kernel is not None or not Path("/proc").is_dir()
    lab.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert lab.proc.wait(60) == 0
    assert not _alive(pid), "JupyterLab outlived msglab lab"
    assert kernel is None or not _alive(kernel), "a kernel outlived msglab lab"
    assert not _answers(host, int(nats_port)), "the nats-server outlived msglab lab"
    assert not _answers("127.0.0.1", lab.port)
    assert not list(Path(tempfile.gettempdir()).glob(f"msglab-nats-{lab.proc.pid}-*")), "server store left behind"


def test_lab_uses_nats_url_and_leaves_that_server_alone(start_lab) -> None:
    """With NATS_URL set, msglab starts no server, reports the one named, and a SIGTERM stops only JupyterLab."""
    with EmbeddedServer() as mine:
        lab = start_lab({"NATS_URL": mine.url})
        printed = "\n".join(lab.lines)
        assert f"nats-server {mine.version} with JetStream at {mine.url}" in printed
        assert "msglab started no server" in printed
        pid = lab.jupyter_pid()
        if Path("/proc").is_dir():
            assert _environ(pid)["NATS_URL"] == mine.url
        lab.proc.send_signal(signal.SIGTERM)
        assert lab.proc.wait(60) == 0
        assert not _alive(pid)
        assert mine.proc is not None and mine.proc.poll() is None, "msglab lab stopped a server it did not start"
        assert _answers(mine.host, mine.port or 0)


def test_a_taken_port_is_refused_with_a_hint() -> None:
    """--port on a port already in use is an error that says what to do, not a JupyterLab traceback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(LabStartError, match="already in use"):
            choose_port(sock.getsockname()[1])
