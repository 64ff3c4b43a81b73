"""A grading worker: `python -m msglab.classroom.worker COURSE_ROOT`, one verdict at a time.

`msglab grade` starts one per job. Each imports the grading platform and every lab's grader once,
then reads tasks as JSON lines on stdin ({"lab": ..., "source": ..., "seed": ...}) and answers each
with one JSON line on a private copy of its stdout: the verdict as JSON (or the grader's error),
the seconds it took, and the CPU it cost (its own and every process it started and reaped: the
server, the run's fork server, the learner processes). Everything else it or a library prints goes to
stderr, so nothing can break the protocol.

A plain subprocess, not multiprocessing: it never re-imports the caller's __main__, and a worker
that dies costs one verdict (reported as a grader error), not the whole pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from typing import Any


def _cpu() -> float:
    from msglab.grading.zygote import forked_cpu

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    # The runs' learner processes are reaped by the nursery, which lives as long as this worker: they
    # are not among our reaped children yet, so each run's zygote reports them.
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime + forked_cpu()


def grade_one(lab: str, source: str, seed: int) -> dict[str, Any]:
    """Grade one file; the verdict as JSON, or the grader's error, with seconds and CPU."""
    from msglab.errors import MsglabError
    from msglab.grading.grade import grade

    cpu, started = _cpu(), time.perf_counter()
    try:
        verdict = grade(lab, source=source, seed=seed)
        outcome: dict[str, Any] = {"verdict": verdict.to_json()}
    except MsglabError as exc:
        outcome = {"error": str(exc).splitlines()[0]}
    except Exception as exc:  # the grader's own bug: a row that says so, never a crashed class
        outcome = {"error": f"the grader failed: {exc!r}"}
    outcome.update(seconds=time.perf_counter() - started, cpu=_cpu() - cpu)
    return outcome


def main() -> None:
    os.environ["MSGLAB_ROOT"] = sys.argv[1]
    for name in ("NATS_URL", "MSGLAB_STATE_DIR"):
        os.environ.pop(name, None)  # every verdict on a fresh server of its own; no attempts recorded
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, anything printed goes to stderr
    import importlib

    from msglab.catalog import all_labs

    for lab in all_labs():
        with contextlib.suppress(ImportError):  # the verdict that needs it reports it
            importlib.import_module(lab.grader_module)
    channel.write(json.dumps({"ready": True, "cpu": _cpu()}) + "\n")
    for line in sys.stdin:
        task = json.loads(line)
        channel.write(json.dumps(grade_one(task["lab"], task["source"], int(task["seed"]))) + "\n")


if __name__ == "__main__":
    main()
