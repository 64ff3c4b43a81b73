"""Fault injection, kept apart from checking (as Maelstrom keeps its nemesis apart).

The grader draws a fault plan from a seed and hands it to a child process in MSGLAB_FAULTS.
Inside the child, effect wrappers call `crash_point(name, when)`; when the plan says so, the
crash is logged to the effect store and the process SIGKILLs itself: no cleanup, no flushed
buffers, no ack sent, exactly like a machine losing power.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from .effects import EffectLog

WHEN = ("before", "after")  # before the effect is committed, or after it


@dataclass(frozen=True)
class Crash:
    """Crash on the `call`-th call (1-based) of effect `effect`, `when` it is taken."""

    effect: str
    call: int
    when: str = "before"

    def describe(self) -> str:
        return f"crash {self.when} the effect on call #{self.call} of {self.effect}"


def encode(plan: list[Crash]) -> str:
    """The plan as the JSON string a child reads from MSGLAB_FAULTS."""
    return json.dumps([asdict(c) for c in plan])


def rng(seed: int, stream: str) -> random.Random:
    """An independent random stream per purpose, so adding one draw never shifts another."""
    return random.Random(f"{seed}:{stream}")


class Nemesis:
    """The child-side half: counts effect calls and crashes where the plan says."""

    def __init__(self, plan: list[Crash], log: EffectLog) -> None:
        self.plan = plan
        self.log = log
        self.calls: Counter[str] = Counter()

    @classmethod
    def from_env(cls, log: EffectLog) -> Nemesis:
        raw = os.environ.get("MSGLAB_FAULTS", "[]")
        return cls([Crash(**c) for c in json.loads(raw)], log)

    def called(self, effect: str) -> int:
        """Count one call of effect; returns its 1-based number."""
        self.calls[effect] += 1
        return self.calls[effect]

    def point(self, effect: str, call: int, when: str, key: Any = None) -> None:
        """Crash here if the plan names this effect, call number and moment."""
        for crash in self.plan:
            if (crash.effect, crash.call, crash.when) == (effect, call, when):
                self.log.record("crash", effect, None if key is None else str(key), call=call, when=when)
                os.kill(os.getpid(), signal.SIGKILL)
