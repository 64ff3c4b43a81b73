"""Several submissions graded at once against one shared server (as `msglab server` starts it),
one of them a vandal: each run holds a slot (an account of its own) whose user may touch only its own
names and never sees the admin's URL, so the vandal's attempts on the others are refused, the honest
runs pass, and the vandal fails."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import PRELUDE, mark_folder

from msglab.broker.server import EmbeddedServer
from msglab.broker.users import SharedUsers
from msglab.catalog import all_labs
from msglab.grading.grade import grade

VANDAL = """
import asyncio as _asyncio

async def _vandalise(env):
    # The admin's URL (the grader's NATS_URL) would open every slot: not in its environment, nor in the
    # initial blocks of this process and its parent (after making itself dumpable again).
    import ctypes
    ctypes.CDLL("libc.so.6").prctl(4, 1)
    for where in ("os.environ", "/proc/self/environ", f"/proc/{_os.getppid()}/environ"):
        try:
            block = repr(dict(_os.environ)) if where == "os.environ" else open(where, "rb").read().decode()
        except OSError as exc:
            _report(f"outcome refused {where} {type(exc).__name__}")
            continue
        _report(f"outcome found the admin in {where}" if "admin:" in block else f"outcome refused: no admin in {where}")
    mine = env.stream("X")[:3]  # e.g. S07
    others = [f"S{n:02d}_{name}" for n in range(1, 33) for name in ("ORDERS", "BILLING", "PAYMENTS", "INVOICES")
              if f"S{n:02d}" != mine]

    async def attempt(what, call):
        try:
            await _asyncio.wait_for(call, 1.0)
            _report(f"outcome {what} succeeded")
        except Exception as exc:
            _report(f"outcome refused {what} {type(exc).__name__}")

    await attempt("list streams", env.js.streams_info())
    await _asyncio.gather(*(attempt(f"purge {s}", env.js.purge_stream(s)) for s in others[:8]),
                          *(attempt(f"delete {s}", env.js.delete_stream(s)) for s in others[8:16]))
    # A SUB is not answered; it is refused if nothing of another run ever arrives on it.
    seen = []
    sub = await env.nc.subscribe(">", cb=lambda msg: seen.append(msg.subject))
    for _ in range(100):
        if any(not subject.startswith(env.subject("")) for subject in seen):
            break
        await _asyncio.sleep(0.01)
    _report("outcome read another run's messages" if seen else "outcome refused subscribe to everything")
_hostile(_vandalise, once=True)
"""


@pytest.fixture
def shared_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A shared server with slot users, as `msglab server` runs it; NATS_URL carries the admin's URL."""
    users = SharedUsers()
    folder = tempfile.mkdtemp(prefix="msglab-shared-test-")
    config = os.path.join(folder, "server.conf")
    Path(config).write_text(users.config())
    with EmbeddedServer(config=config) as server:
        monkeypatch.setenv("NATS_URL", users.admin_url(server.url))
        yield server.url
    os.unlink(config)
    os.rmdir(folder)


def test_a_vandal_cannot_touch_other_runs_on_a_shared_server(shared_server: str, tmp_path: Path) -> None:
    labs = all_labs()[:1]  # one lab's vandal and two honest runs: the slots are the platform's, not a lab's
    mark = mark_folder("msglab-vandal-")  # outside pytest's private tmp: the learner's user writes here
    first = labs[0]
    vandal = tmp_path / first.file
    vandal.write_text(first.source().read_text() + PRELUDE.format(mark=str(mark)) + VANDAL)
    jobs = [(first.number, vandal, 1)] + [
        (lab.number, lab.source(solution=True), seed) for lab in labs for seed in (1, 2)
    ]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        verdicts = list(pool.map(lambda job: grade(job[0], source=job[1], seed=job[2]), jobs))
    assert not verdicts[0].passed, verdicts[0].to_text()
    for verdict in verdicts[1:]:
        assert verdict.passed, verdict.to_text()
        assert "enforced by its user" in verdict.server
    outcomes = [p.read_text() for p in mark.iterdir() if not p.name.endswith(".part")]
    for report in mark.iterdir():
        report.unlink()
    mark.rmdir()
    assert outcomes, "the vandal never ran"
    assert all(o.startswith("outcome refused") for o in outcomes), [
        o for o in outcomes if "succeeded" in o or "found" in o
    ]
    # The control: the grader's environment holds the admin's URL; the vandal looked for it in all three places.
    assert "admin:" in os.environ["NATS_URL"]
    assert sum("no admin in" in o for o in outcomes) >= 2, outcomes
