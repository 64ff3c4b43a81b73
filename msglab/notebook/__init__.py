"""Grading from a notebook cell: the same verdict as the CLI, rendered as rich output.

The grader runs in a fresh `python -m msglab check ... --json` process, so a learner's kernel
state (an old import of the lab file, a running event loop, a half-finished experiment) can
never change a verdict.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from typing import Any

from msglab.errors import MsglabError
from msglab.grading.verdict import Verdict


class CheckError:
    """A check that could not run (unknown lab, no server): shown as a message, not a traceback."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<div style='color:#9a6700'><b>msglab could not check:</b><pre>{html.escape(self.text)}</pre></div>"


def check(lab: str, *, solution: bool = False, seed: int | None = None, attempt: bool = True) -> Verdict | CheckError:
    """Grade lab `lab` in a fresh process and return the verdict for display.

    `attempt=False`: a lesson's demonstration, not the learner's attempt (no hint level opens).
    """
    args = [sys.executable, "-m", "msglab", "check", str(lab), "--json"]
    if solution:
        args.append("--solution")
    if not attempt:
        args.append("--no-attempt")
    if seed is not None:
        args += ["--seed", str(seed)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode in (0, 1) and done.stdout.strip():
        return Verdict.from_json(done.stdout)
    return CheckError(_error_text(done.stdout) or done.stderr.strip() or f"msglab check exited with {done.returncode}")


def _error_text(stdout: str) -> str:
    """The message of a `--json` error ({"error": ..., "hint": ...}), as the terminal would show it."""
    try:
        error = json.loads(stdout)
        return f"{error['error']}\n  hint: {error['hint']}" if error.get("hint") else str(error["error"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return stdout.strip()


class Text:
    """Plain text that a notebook shows as it is (not as a quoted string)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.text)}</pre>"


def hint(lab: str) -> Any:
    """The hint levels open for the checks that failed in your last check of `lab` (`msglab hint`)."""
    from msglab.attempts import hint_text
    from msglab.catalog import find_lab

    try:
        return Text(hint_text(find_lab(lab)))
    except MsglabError as exc:  # an unknown lab: a message, not a traceback
        return CheckError(str(exc))


def progress() -> Any:
    """Every lab: passed or not, when it first passed, with which seed, attempts (`msglab progress`)."""
    from msglab.attempts import progress as report

    return report()
