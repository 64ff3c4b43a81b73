"""The example lab of docs/authoring.md (examples/00_echo) is graded like a course lab, and stays
out of the course: its starter fails, its solution passes, each variant gets the verdict its
docstring names, with the words its `Says:` lines require."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from msglab.catalog import all_labs, course_root, load_lab
from msglab.grading import contract
from msglab.grading.grade import grade

EXAMPLE = load_lab(course_root() / "examples" / "00_echo")
SEEDS = (1, 2)
VARIANTS = sorted((EXAMPLE.folder / "variants").glob("*.py"))


def test_the_example_is_not_part_of_the_course_but_keeps_the_grader_contract() -> None:
    assert EXAMPLE.name not in {lab.name for lab in all_labs()}
    assert EXAMPLE.grader_module == "msglab.grading.example"
    assert contract.problems(importlib.import_module(EXAMPLE.grader_module)) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_example_starter_fails_and_teaches(no_nats_url: None, seed: int) -> None:
    verdict = grade(EXAMPLE, seed=seed)
    assert "all_acked" in {c.name for c in verdict.failures}, verdict.to_text()
    assert all(c.message and c.hint for c in verdict.failures), verdict.to_text()


@pytest.mark.parametrize("seed", SEEDS)
def test_example_solution_passes(no_nats_url: None, seed: int) -> None:
    verdict = grade(EXAMPLE, solution=True, seed=seed)
    assert verdict.passed, verdict.to_text()
    assert {c.name for c in verdict.checks} <= set(EXAMPLE.checks)  # every check has its hints


@pytest.mark.parametrize("path", VARIANTS, ids=[p.stem for p in VARIANTS])
@pytest.mark.parametrize("seed", SEEDS)
def test_example_variant_gets_its_verdict(no_nats_url: None, path: Path, seed: int) -> None:
    text = path.read_text()
    expected = set(re.findall(r"^Expect: fail (.+)$", text, re.M)[0].replace(" ", "").split(","))
    verdict = grade(EXAMPLE, source=path, seed=seed)
    assert expected <= {c.name for c in verdict.failures}, verdict.to_text()
    for says in re.findall(r"^Says: (.+)$", text, re.M):
        assert says.lower() in verdict.to_text().lower(), verdict.to_text()
