"""`msglab classroom status`: every learner, their connections and streams, and the labs they passed.

The server's side comes from the room's nats-server itself, asked as the instructor (the system
account): `$SYS.REQ.ACCOUNT.PING.STATZ` (connections per account) and `$SYS.REQ.SERVER.PING.JSZ`
(streams, messages and bytes per account). The labs passed come from a gradebook (`msglab grade`'s
gradebook.csv) and from verdicts learners handed in (`msglab check NN --json > verdict.json`, in a
folder per learner, or the verdicts/ folder `msglab grade` writes).
"""

from __future__ import annotations

import asyncio
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msglab.classroom.server import INSTRUCTOR, MIB, Classroom
from msglab.errors import MsglabError


@dataclass
class LearnerStatus:
    name: str
    connections: int | None = None  # None: the server was not asked (or did not answer)
    streams: dict[str, dict[str, int]] = field(default_factory=dict)  # stream -> messages, bytes
    storage: int = 0  # bytes of file storage in use
    memory: int = 0
    passed: set[str] = field(default_factory=set)  # lab numbers


@dataclass
class Status:
    learners: dict[str, LearnerStatus]
    server: str  # what the server said, or why it could not be asked
    limits: str


async def _ask(url: str, names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    from msglab.broker import connect

    nc = await connect(url, name="msglab-classroom-status", max_reconnect_attempts=0)
    try:
        accounts = json.dumps({"accounts": names, "include_unused": True}).encode()
        statz = await nc.request("$SYS.REQ.ACCOUNT.PING.STATZ", accounts, timeout=2)
        streams = json.dumps({"accounts": True, "streams": True}).encode()
        jsz = await nc.request("$SYS.REQ.SERVER.PING.JSZ", streams, timeout=2)
        return json.loads(statz.data), json.loads(jsz.data)
    finally:
        await nc.close()


def server_status(classroom: Classroom, learners: dict[str, LearnerStatus]) -> str:
    """Fill in connections and streams from the running server; return a line about the server."""
    try:
        statz, jsz = asyncio.run(_ask(classroom.local_url(INSTRUCTOR), list(learners)))
    except (MsglabError, OSError, TimeoutError) as exc:
        return (
            f"the classroom server does not answer ({str(exc).splitlines()[0]}): start it with `msglab classroom serve`"
        )
    except Exception as exc:  # nats' own errors: a status line, not a traceback
        return f"the classroom server did not answer the instructor's requests: {exc!r}"
    for account in statz.get("data", {}).get("account_statz", []):
        if account.get("acc") in learners:
            learners[account["acc"]].connections = int(account.get("conns", 0))
    for name in learners:
        learners[name].connections = learners[name].connections or 0
    data = jsz.get("data", {})
    for account in data.get("account_details", []):
        learner = learners.get(account.get("name", ""))
        if learner is None:
            continue
        learner.storage, learner.memory = int(account.get("storage", 0)), int(account.get("memory", 0))
        for stream in account.get("stream_detail", []) or []:
            state = stream.get("state", {})
            learner.streams[stream["name"]] = {"messages": int(state.get("messages", 0)),
                                               "bytes": int(state.get("bytes", 0))}  # fmt: skip
    server = statz.get("server", {})
    return f"nats-server {server.get('ver', '?')} at {classroom.local_url(INSTRUCTOR).split('@')[-1]}"


def passed_from_gradebook(path: Path) -> dict[str, set[str]]:
    """learner -> labs passed, from a gradebook.csv."""
    passed: dict[str, set[str]] = {}
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row.get("passed") == "yes":
                passed.setdefault(row["learner"], set()).add(row["lab"])
    return passed


def passed_from_verdicts(folder: Path) -> dict[str, set[str]]:
    """learner -> labs passed, from verdict JSON files in a folder per learner."""
    passed: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*/*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        verdict = data.get("verdict", data) if isinstance(data, dict) else None
        if not isinstance(verdict, dict) or verdict.get("solution"):
            continue
        learner = str(data.get("learner") or path.parent.name)
        if verdict.get("passed") and verdict.get("lab"):
            passed.setdefault(learner, set()).add(str(verdict["lab"]).split("_")[0])
    return passed


def status(folder: Path, gradebook: Path | None = None, verdicts: Path | None = None) -> Status:
    classroom = Classroom.load(folder)
    learners = {name: LearnerStatus(name) for name in classroom.learners}
    server = server_status(classroom, learners)
    for source in ([passed_from_gradebook(gradebook)] if gradebook else []) + (
        [passed_from_verdicts(verdicts)] if verdicts else []
    ):
        for name, labs in source.items():
            if name in learners:
                learners[name].passed |= labs
    return Status(learners, server, classroom.limits.describe())


def size(count: int) -> str:
    """Bytes as a person reads them: 0 B, 12.3 KiB, 4.5 MiB."""
    if count < 1024:
        return f"{count} B"
    if count < MIB:
        return f"{count / 1024:.1f} KiB"
    return f"{count / MIB:.1f} MiB"


def render(report: Status) -> str:
    lines = [f"classroom server: {report.server}", f"limits per learner: {report.limits}", ""]
    lines.append(f"  {'learner':<16} {'conns':>5} {'streams':>7} {'messages':>9} {'storage':>10}  labs passed")
    for learner in report.learners.values():
        conns = "-" if learner.connections is None else str(learner.connections)
        messages = sum(s["messages"] for s in learner.streams.values())
        used = size(learner.storage + learner.memory)
        labs = " ".join(sorted(learner.passed)) or "-"
        names = ", ".join(sorted(learner.streams)[:4]) + (" ..." if len(learner.streams) > 4 else "")
        lines.append(f"  {learner.name:<16} {conns:>5} {len(learner.streams):>7} {messages:>9} {used:>10}  {labs}"
                     + (f"   [{names}]" if names else ""))  # fmt: skip
    return "\n".join(lines)
