"""Doing nothing earns nothing: the `requires` gate, core weights, and the starter recognised by its code.

Synthetic labs in tmp folders (lab.toml written here), verdicts built by hand: the mechanism, not a
lab's grader, is under test. The real labs' scores under it are measured in the classroom report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from msglab.catalog import find_lab
from msglab.classroom.gradescope import results_json
from msglab.classroom.points import CORE_POINTS, lab_points, same_code, score
from msglab.errors import LabError
from msglab.grading.verdict import Check, Verdict

STARTER = b'''"""Lab 99: charge each payment once."""

import json


async def handle(env, msg):
    """Charge the payment."""
    payment = json.loads(msg.data)
    # TODO: charge it once, whatever the broker does
    await env.charge(payment)
'''


def lab(root: Path, monkeypatch: pytest.MonkeyPatch, grading: str = "", points: str = "") -> None:
    monkeypatch.setenv("MSGLAB_ROOT", str(root))
    folder = root / "labs" / "99_demo"
    folder.mkdir(parents=True, exist_ok=True)
    hints = "".join(f'[hints.{check}]\nconcept = "x"\n' for check in ("charged", "charged_once", "faults_fired"))
    (folder / "lab.toml").write_text(f'title = "demo"\nfile = "demo.py"\n{hints}{points}[grading]\n{grading}')
    (folder / "demo.py").write_bytes(STARTER)


def verdict(**passed: bool) -> Verdict:
    checks = [Check(name, name.replace("_", " "), ok, "" if ok else "seen") for name, ok in passed.items()]
    return Verdict(lab="99_demo", graded="demo.py", seed=1, checks=checks)


def test_while_the_work_did_not_happen_the_vacuous_checks_earn_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lab(tmp_path, monkeypatch, grading='requires = ["charged"]\n')
    points = lab_points(find_lab("99"))
    assert points.requires == ("charged",) and points.maximum == 4.0  # and no_unplanned_deaths, on every verdict
    # Nothing charged, so nothing charged twice: charged_once and faults_fired hold vacuously.
    idle = score(verdict(charged=False, charged_once=True, faults_fired=True), points)
    assert (idle.score, idle.status, idle.earned) == (0.0, "graded", {})
    assert "work did not happen (charged failed)" in idle.note
    # The work happened: every passed check earns, the failed one does not.
    working = score(verdict(charged=True, charged_once=False, faults_fired=True), points)
    assert (working.score, working.earned, working.note) == (2.0, {"charged": 1.0, "faults_fired": 1.0}, "")
    # A required check the verdict does not report at all counts as not passed.
    assert score(verdict(charged_once=True, faults_fired=True), points).score == 0.0


def test_without_a_gate_every_passed_check_earns_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lab(tmp_path, monkeypatch)
    points = lab_points(find_lab("99"))
    assert points.requires == () and points.core == ()
    assert score(verdict(charged=False, charged_once=True, faults_fired=True), points).score == 2.0


def test_core_invariants_weigh_more_than_the_platforms_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lab(tmp_path, monkeypatch, grading='requires = ["charged"]\ncore = ["charged_once", "charged"]\n')
    points = lab_points(find_lab("99"))
    assert points.points == {"charged": CORE_POINTS, "charged_once": CORE_POINTS, "faults_fired": 1.0,
                             "no_unplanned_deaths": 1.0}  # fmt: skip
    assert points.points["charged_once"] > points.points["faults_fired"]
    lab(tmp_path, monkeypatch, grading='core = ["charged_once"]\n', points="[points]\ncharged_once = 5\n")
    assert lab_points(find_lab("99")).points["charged_once"] == 5.0  # [points] has the last word


@pytest.mark.parametrize(
    "grading, said",
    [
        ('requires = ["charged_twice"]\n', "grading.requires names charged_twice, not a check of the lab"),
        ('requires = "charged"\n', "grading.requires must be a list of check ids"),
        ("core = [1]\n", "grading.core must be a list of check ids"),
    ],
)
def test_a_broken_gate_is_named_with_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grading: str, said: str
) -> None:
    lab(tmp_path, monkeypatch, grading=grading)
    with pytest.raises(LabError, match=said) as raised:
        lab_points(find_lab("99"))
    assert "99_demo/lab.toml" in str(raised.value)


def test_the_starter_is_recognised_by_its_code_not_its_bytes() -> None:
    commented = STARTER + b"# done, I think\n"
    reworded = STARTER.replace(b'"""Charge the payment."""', b'"""Charges it (finished!)."""')
    reflowed = STARTER.replace(b"    await env.charge(payment)\n", b"    await env.charge(\n        payment\n    )\n")
    for same in (STARTER, commented, reworded, reflowed, STARTER.replace(b"# TODO: charge", b"# DONE: charge")):
        assert same_code(same, STARTER), same
    changed = STARTER.replace(b"await env.charge(payment)", b"await env.charge(payment, idempotency_key=payment['id'])")
    for other in (changed, STARTER + b"print('hi')\n", b"def broken(:\n", b"\xff\xfe"):
        assert not same_code(other, STARTER), other


def test_gradescope_shows_a_vacuous_pass_earning_nothing_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lab(tmp_path, monkeypatch, grading='requires = ["charged"]\n')
    demo = find_lab("99")
    points = lab_points(demo)
    seen = verdict(charged=False, charged_once=True, faults_fired=True)
    record = {"lab": demo, "points": points, "seed": 7, "verdict": seen, "result": score(seen, points)}
    results = results_json([record])
    assert results["score"] == 0.0 == sum(t["score"] for t in results["tests"])
    vacuous = next(t for t in results["tests"] if "charged_once" in t["tags"])
    assert vacuous["status"] == "passed" and vacuous["score"] == 0.0 and "work did not happen" in vacuous["output"]


def test_a_commented_starter_and_a_handler_that_blocks_forever_score_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_nats_url: None
) -> None:
    """On the real lab 03 grader, with the gate its lab.toml declares: both used to score (5 and 4 of 8)."""
    from msglab.classroom import sample
    from msglab.classroom.gradebook import grade_class

    course = sample.copy_course(tmp_path / "course", ["03_idempotency"], ROOT)
    monkeypatch.setenv("MSGLAB_ROOT", str(course))
    payments = find_lab("03")
    starter = payments.source().read_text()
    handler = "async def handle_payment(env, msg) -> None:\n"
    blocked = starter.replace(handler, handler + "    import asyncio\n\n    await asyncio.Event().wait()\n", 1)
    assert blocked != starter
    for learner, text in (("commented", starter + "# finished, I think\n"), ("blocked", blocked)):
        (tmp_path / "class" / learner).mkdir(parents=True)
        (tmp_path / "class" / learner / payments.file).write_text(text)
    result = grade_class(tmp_path / "class", out=tmp_path / "out", jobs=2, progress=False)
    rows = {row.learner: row for row in result.rows}
    assert rows["commented"].result is not None and rows["blocked"].result is not None
    assert (rows["commented"].result.status, rows["commented"].result.score) == ("starter", 0.0)
    blocked_result = rows["blocked"].result
    assert (blocked_result.status, blocked_result.score) == ("graded", 0.0), blocked_result
    assert "faults_fired" in blocked_result.failed and "work did not happen" in blocked_result.note
    assert "work did not happen" in (tmp_path / "out" / "feedback" / "blocked.txt").read_text()


def test_a_starter_rewritten_without_changing_what_it_does_scores_as_the_starter_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_nats_url: None
) -> None:
    from msglab.classroom.gradebook import grade_class

    payments = find_lab("03")  # its starter fails the same checks on every run of a seed
    renamed = payments.source().read_text().replace("msgs", "batch")  # another syntax tree, the same behaviour
    assert "batch" in renamed and not same_code(renamed.encode(), payments.source().read_bytes())
    (tmp_path / "class" / "renamer").mkdir(parents=True)
    (tmp_path / "class" / "renamer" / payments.file).write_text(renamed)
    (tmp_path / "class" / "solver").mkdir(parents=True)
    (tmp_path / "class" / "solver" / payments.file).write_bytes(payments.source(solution=True).read_bytes())
    plain = grade_class(tmp_path / "class", labs=[payments], out=tmp_path / "plain", jobs=2, progress=False)
    by_code = {row.learner: row.result for row in plain.rows}
    assert by_code["renamer"] is not None and by_code["renamer"].status == "graded"
    assert by_code["renamer"].score, "the starter's own passed checks earn, when only its code is compared"
    asked = grade_class(tmp_path / "class", labs=[payments], out=tmp_path / "asked", jobs=2, progress=False,
                        salt=plain.salt, starter_behaviour=True)  # fmt: skip
    by_behaviour = {row.learner: row.result for row in asked.rows}
    renamer, solver = by_behaviour["renamer"], by_behaviour["solver"]
    assert renamer is not None and (renamer.status, renamer.score) == ("starter", 0.0), renamer
    assert "behaves as the starter on seed" in renamer.note
    assert solver is not None and solver.passed and solver.status == "graded", "a passing file is never compared"


def test_every_lab_gates_its_points_on_its_planned_faults_and_weighs_its_own_invariants_most() -> None:
    """Each lab's do-nothing file (tests/variants/<lab>/blocks_forever.py, where a worker can block: it must fail
    faults_fired) then scores 0; and its core invariants outweigh the platform's own checks."""
    from msglab.catalog import all_labs

    for lab in all_labs():
        points = lab_points(lab)
        assert "faults_fired" in points.requires, f"{lab.name}: a file that never meets a planned fault earns points"
        assert len(points.core) >= 3 and all(points.points[c] > points.points["faults_fired"] for c in points.core)
        blocks = ROOT / "tests" / "variants" / lab.name / "blocks_forever.py"
        if blocks.is_file():
            assert "Expect: fail faults_fired" in blocks.read_text()
