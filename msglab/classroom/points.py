"""A lab's checks and their points, read from its lab.toml, and a verdict turned into a score.

    [points]                      # optional: check id = points
    no_lost_emails = 3
    [grading]
    starter_points = 0            # optional (default 0): what the starter, or code that is the starter, scores
    requires = ["no_lost_emails"] # optional: the checks that show the lab's work happened
    core = ["no_duplicate_emails"]# optional: the lab's own invariants, CORE_POINTS each unless [points] says

The lab's checks are the ids with a `[hints.<check id>]` table (the lab pattern: one per check the
grader can fail) plus any id `[points]` names; each is worth 1 point (a `core` check CORE_POINTS)
unless `[points]` says otherwise. So a lab's maximum is known without running anything, and a file
that does not import scores 0 of that full maximum. `file_imports` and `finishes` are not checks of
the lab: they say the lab's checks never ran, which scores 0.

Doing nothing earns nothing. Many checks hold vacuously: nothing charged, so nothing charged twice;
nothing delivered, so no delivery before its ack. So while any `requires` check fails, the lab's
other checks earn nothing (the passed `requires` checks still earn theirs). And a file whose code is
the starter's (the same syntax tree: comments, blank lines, docstrings and formatting do not count)
scores `starter_points`, whatever its checks did. A lab that declares no `requires` scores every
passed check, as before.

A verdict that holds a check id the lab does not declare is a grader error (the course's lab.toml
and grader disagree), never a score.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field

from msglab.catalog import Lab
from msglab.errors import LabError
from msglab.grading.verdict import Verdict

DID_NOT_RUN = ("file_imports", "finishes")  # failures that mean the lab's own checks never ran
# Rules 1 and 3: grade.py appends these to every verdict, whether or not a lab.toml has hints for them.
EVERY_VERDICT = ("faults_fired", "no_unplanned_deaths")
CORE_POINTS = 3.0  # a core invariant's default worth: the lab's story, not the platform's bookkeeping


@dataclass(frozen=True)
class LabPoints:
    """The points of one lab's checks."""

    lab: str  # the lab's folder name
    points: dict[str, float] = field(default_factory=dict)  # check id -> points
    starter_points: float = 0.0
    requires: tuple[str, ...] = ()  # checks that show the lab's work happened: the others earn only after them
    core: tuple[str, ...] = ()  # the lab's own invariants

    @property
    def maximum(self) -> float:
        return float(sum(self.points.values()))


@dataclass
class Score:
    """What one verdict earned."""

    score: float | None  # None: a grader error, no score
    maximum: float
    passed: bool
    failed: list[str]  # check ids that failed
    status: str  # graded, starter, did not run, grader error
    note: str = ""
    earned: dict[str, float] | None = None  # check id -> the points it earned (None: every passed check's)


def lab_points(lab: Lab) -> LabPoints:
    """Read `[points]`, `[hints.*]` and `[grading]` from the lab's lab.toml."""
    path = lab.folder / "lab.toml"
    try:
        meta = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LabError(f"{path} cannot be read: {exc}", hint="fix the lab's lab.toml") from exc

    def broken(what: str) -> LabError:
        return LabError(f"{path}: {what}", hint="[points] maps check ids to numbers; [grading] starter_points is one")

    hints = meta.get("hints", {})
    table = meta.get("points", {})
    grading = meta.get("grading", {})
    if not isinstance(hints, dict) or not isinstance(table, dict) or not isinstance(grading, dict):
        raise broken("`hints`, `points` and `grading` must be tables")
    points: dict[str, float] = {check: 1.0 for check in hints if check not in DID_NOT_RUN}
    if points or table:
        points.update({check: 1.0 for check in EVERY_VERDICT if check not in points})
    declared = set(points) | set(table)
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("requires", "core"):
        value = grading.get(key, [])
        if not isinstance(value, list) or not all(isinstance(check, str) for check in value):
            raise broken(f"grading.{key} must be a list of check ids (got {value!r})")
        unknown = [check for check in value if check not in declared]
        if unknown:
            raise broken(f"grading.{key} names {', '.join(unknown)}, not a check of the lab (no [hints.*] table)")
        lists[key] = tuple(value)
    for check in lists["core"]:
        points[check] = CORE_POINTS
    for check, value in table.items():
        if check in DID_NOT_RUN:
            raise broken(f"points.{check}: {check} is not a check of the lab (it means the checks never ran)")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise broken(f"points.{check} must be a number of points, 0 or more (got {value!r})")
        points[check] = float(value)
    starter = grading.get("starter_points", 0)
    if isinstance(starter, bool) or not isinstance(starter, int | float) or starter < 0:
        raise broken(f"grading.starter_points must be a number, 0 or more (got {starter!r})")
    if points and starter > sum(points.values()):
        raise broken(f"grading.starter_points ({starter}) is more than the lab's maximum ({sum(points.values())})")
    return LabPoints(lab.name, points, float(starter), lists["requires"], lists["core"])


def same_code(content: bytes, starter: bytes) -> bool:
    """True when `content` is the starter's code: the same syntax tree, whatever its comments and layout."""
    if content == starter:
        return True
    try:
        return _tree(content) == _tree(starter)
    except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return False


def _tree(source: bytes) -> str:
    tree = ast.parse(source)
    for node in ast.walk(tree):  # a docstring is a comment too: rewording it changes no behaviour
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):  # fmt: skip
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False)


def score(verdict: Verdict, points: LabPoints, *, starter: bool = False) -> Score:
    """The points a verdict earned (its passed checks' points), or a grader error saying why not.

    `starter`: the file graded is the lab's starter (see `same_code`), which scores what lab.toml's
    `[grading] starter_points` says, whatever its checks did. While a `requires` check failed,
    only the `requires` checks earn points (see the module docstring).
    """
    failed = [check.name for check in verdict.failures]
    if not points.points:
        why = f"{points.lab}/lab.toml declares no checks: add [hints.<check id>] or [points] tables"
        return Score(None, 0.0, verdict.passed, failed, "grader error", why)
    unknown = sorted({check.name for check in verdict.checks} - set(points.points) - set(DID_NOT_RUN))
    if unknown:
        why = f"the grader reported checks {points.lab}/lab.toml does not declare: {', '.join(unknown)}"
        return Score(None, points.maximum, verdict.passed, failed, "grader error", why)
    if starter:
        return Score(points.starter_points, points.maximum, False, failed, "starter", "the starter's code, unchanged")
    stopped = [check for check in verdict.failures if check.name in DID_NOT_RUN]
    if stopped:
        first = stopped[0].message.splitlines()[0] if stopped[0].message else stopped[0].title
        return Score(0.0, points.maximum, False, failed, "did not run", first)
    passed = {check.name for check in verdict.checks if check.passed}
    missing = [check for check in points.requires if check not in passed]
    earning = set(points.requires) if missing else set(points.points)
    earned = {check: points.points[check] for check in sorted(passed & earning)}
    note = (f"the lab's work did not happen ({', '.join(missing)} failed): its other checks earn nothing"
            if missing else "")  # fmt: skip
    return Score(float(sum(earned.values())), points.maximum, verdict.passed, failed, "graded", note, earned)


def number(value: float | None) -> str:
    """A score as the gradebook writes it: 3, 2.5, or empty for none."""
    if value is None:
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}".rstrip("0")
