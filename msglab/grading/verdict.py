"""What a grader returns: named checks over invariants, with evidence, one hint, and the seed.

Rendered three ways from one object: plain text (CLI), JSON (`--json`, autograders) and HTML
(notebooks). A verdict never starts with a stack trace, and a passed check carries no hint.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    """One invariant: did it hold, and if not, the evidence and a hint."""

    name: str  # stable id, e.g. "no_lost_emails"; tests assert on it
    title: str  # what the invariant says, in words
    passed: bool
    message: str = ""  # what was seen (for a failure: the broken invariant and its evidence)
    trace: list[str] = field(default_factory=list)  # a short counterexample, one event a line
    hint: str = ""


@dataclass
class Verdict:
    """All checks of one grading run."""

    lab: str
    graded: str  # the file that was graded
    seed: int
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    server: str = ""
    output: list[str] = field(default_factory=list)  # the tail of what the learner's code printed
    solution: bool = False  # graded solutions/ instead of labs/
    notes: list[str] = field(default_factory=list)  # from the attempt history: hint levels now open, ...

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def replay_command(self) -> str:
        extra = " --solution" if self.solution else ""
        return f"msglab check {self.lab.split('_')[0]}{extra} --seed {self.seed}"

    def to_json(self) -> str:
        data = asdict(self)
        data["passed"] = self.passed
        for check in data["checks"]:
            if check["passed"]:
                check["hint"] = ""
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        data = json.loads(text)
        data.pop("passed", None)
        data["checks"] = [Check(**c) for c in data["checks"]]
        return cls(**data)

    def to_text(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        lines = [
            f"lab {self.lab}: {head}  ({len(self.checks) - len(self.failures)}/{len(self.checks)} checks, "
            f"{self.seconds:.1f} s, seed {self.seed})",
            f"  graded: {self.graded} on {self.server}",
        ]
        for check in self.checks:
            lines.append(f"  {'ok  ' if check.passed else 'FAIL'} {check.title}")
            if not check.passed:
                lines += [f"       {line}" for line in check.message.splitlines()]
                if check.trace:
                    lines.append("       what happened:")
                    lines += [f"         {step}" for step in check.trace]
                if check.hint:
                    lines.append(f"       hint: {check.hint}")
        if not self.passed and self.output:
            lines.append("  your code printed (last lines):")
            lines += [f"    | {line}" for line in self.output[-8:]]
        lines += [f"  {note}" for note in self.notes]
        if not self.passed:
            lines.append(f"  replay this exact run: {self.replay_command()}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.passed else "#cf222e"
        rows = []
        for check in self.checks:
            mark = "✅" if check.passed else "❌"
            detail = ""
            if not check.passed:
                detail = f"<div style='white-space:pre-wrap'>{html.escape(check.message)}</div>"
                if check.trace:
                    items = "".join(f"<li><code>{html.escape(s)}</code></li>" for s in check.trace)
                    detail += f"<details open><summary>what happened</summary><ol>{items}</ol></details>"
                if check.hint:
                    detail += f"<div><b>hint:</b> {html.escape(check.hint)}</div>"
            rows.append(
                f"<tr><td style='vertical-align:top'>{mark}</td><td><b>{html.escape(check.title)}</b>{detail}</td></tr>"
            )
        head = "PASS" if self.passed else "FAIL"
        notes = "".join(f"<div>{_notebook_words(note)}</div>" for note in self.notes)
        replay = "" if self.passed else f"<div>replay: <code>{html.escape(self.replay_command())}</code></div>"
        return (
            f"<div class='msglab-verdict'><h4 style='color:{colour}'>Lab {html.escape(self.lab)}: {head}</h4>"
            f"<div>seed {self.seed} · {self.seconds:.1f} s · {html.escape(self.graded)}</div>"
            f"<table>{''.join(rows)}</table>{notes}{replay}</div>"
        )


def _notebook_words(note: str) -> str:
    """A note as HTML, its commands as a notebook cell calls them (`msglab hint 01` -> msglab.hint("01"))."""
    text = re.sub(r"`msglab hint (\d+)`", r'`msglab.hint("\1")`', note)
    text = re.sub(r"`msglab check (\d+) --solution`", r'`msglab.check("\1", solution=True)`', text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
