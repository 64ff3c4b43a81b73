"""The contract between the platform and a grader module (`msglab.graders.<topic>`), written down.

Required (the `Grader` Protocol; mypy accepts a module where a Protocol is expected):

    async def grade(run: Run) -> list[Check]       the workload and its checks; grade.py adds rules 1 and 3
    async def playground(env) -> None              the lab notebook's world: same stream and durable, effects that print

Optional, by name (found with getattr, so they are checked by `problems` instead):

    async def role_<name>(env, learner) -> None    a worker role: runs in a learner process until killed
    def ops_<name>(env, learner) -> dict            a service role: coroutines the grader calls one at a time
    PARAMS: dict[str, Any]                         what env carries besides connections and names
    STREAM: str / STREAMS: tuple[str, ...]          every stream it creates (a shared server allows only these)
    DURABLE: str / DURABLES: tuple[str, ...]        the platform's durables (learner code may only read, fetch, ack)
    LEARNER_SUBJECTS: list[str]                    ordinary subjects learner code may publish and subscribe on
    LEARNER_REQUESTS: list[str]                    subjects of the lab's services learner code may request, never serve
    LEARNER_DENY_PUBLISH: list[str]                subjects only course services may publish on

msglab.broker.users reads these to set the learner's permissions: a lab's Topology gives STREAM and
DURABLE (`STREAM, DURABLE = TOPOLOGY.stream, TOPOLOGY.durable`).

tests/test_platform.py holds every grader of the catalogue (and the example lab's) to it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from msglab.grading.harness import Run
    from msglab.grading.verdict import Check


@runtime_checkable
class Grader(Protocol):
    """What every grader module defines."""

    def grade(self, run: Run) -> Awaitable[list[Check]]: ...

    def playground(self, env: Any) -> Awaitable[None]: ...


def roles(module: ModuleType) -> dict[str, str]:
    """The module's learner-process roles: name -> 'worker' (role_<name>) or 'service' (ops_<name>)."""
    found = {}
    for attr in dir(module):
        if attr.startswith("role_"):
            found[attr[len("role_") :]] = "worker"
        elif attr.startswith("ops_"):
            found[attr[len("ops_") :]] = "service"
    return found


def problems(module: ModuleType) -> list[str]:
    """What in `module` breaks the contract (empty: it keeps it)."""
    name = module.__name__
    found: list[str] = []
    if not isinstance(module, Grader):
        found.append(f"{name} lacks grade(run) or playground(env)")
    for attr in ("grade", "playground"):
        if hasattr(module, attr) and not inspect.iscoroutinefunction(getattr(module, attr)):
            found.append(f"{name}.{attr} is not an async def")
    for role, kind in roles(module).items():
        function = getattr(module, f"role_{role}" if kind == "worker" else f"ops_{role}")
        if kind == "worker" and not inspect.iscoroutinefunction(function):
            found.append(f"{name}.role_{role} is not an async def")
        if kind == "service" and inspect.iscoroutinefunction(function):
            found.append(f"{name}.ops_{role} must be a plain def returning a dict of coroutines")
        if len(inspect.signature(function).parameters) != 2:
            found.append(f"{name}: the {role} role must take (env, learner)")
    if not roles(module):
        found.append(f"{name} has no role_<name> or ops_<name>: no learner code would ever run")
    if not isinstance(getattr(module, "PARAMS", {}), dict):
        found.append(f"{name}.PARAMS is not a dict")
    for one, many in (("STREAM", "STREAMS"), ("DURABLE", "DURABLES")):
        if not isinstance(getattr(module, one, ""), str):
            found.append(f"{name}.{one} is not a str")
        if not _names(getattr(module, many, ())):
            found.append(f"{name}.{many} is not a sequence of names")
    for subjects in ("LEARNER_SUBJECTS", "LEARNER_REQUESTS", "LEARNER_DENY_PUBLISH"):
        if not _names(getattr(module, subjects, [])):
            found.append(f"{name}.{subjects} is not a list of subjects")
    return found


def _names(value: object) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
