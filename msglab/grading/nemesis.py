"""Fault injection, kept apart from checking (as Maelstrom keeps its nemesis apart).

The grader draws a fault plan from a seed and keeps it: the learner's process never sees it.
A plan names an effect and the number of its call in one process (`Crash("send_email", 3,
"before")`). When that call reaches the grader over the child's effect channel, the grader
SIGKILLs the child's whole process group before recording the effect ("before") or right after
("after"), and logs the crash: no cleanup runs, no buffer is flushed, no ack is sent, exactly
like a machine losing power. Because the grader pulls the trigger itself, it knows which
planned faults fired; a run whose faults did not fire cannot pass (see msglab.grading).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WHEN = ("before", "after")  # before the effect is recorded, or after it


@dataclass(frozen=True)
class Crash:
    """Crash on the `call`-th call (1-based, counted per process) of effect `effect`, `when` it is taken."""

    effect: str
    call: int
    when: str = "before"
    # The lab's words for this crash, used by rules.faults_check when it did not fire (rule 1):
    point: str = ""  # where it kills, e.g. "right after the invoice went out, on the invoice it sent #2"
    counted: str = ""  # what the call counts, singular, e.g. "invoice" ("made only 1 invoice")
    hint: str = ""  # what the learner's code must do for this crash to be reachable

    def describe(self) -> str:
        return f"SIGKILL {self.when} {self.effect} call #{self.call}"


def rng(seed: int, stream: str) -> random.Random:
    """An independent random stream per purpose, so adding one draw never shifts another."""
    return random.Random(f"{seed}:{stream}")
