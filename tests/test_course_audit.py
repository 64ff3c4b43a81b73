"""The course audits itself (as rustlings does): every lab has TODOs, a solution and a README, names
follow the numbering rule, each lab has a variant pasted from its lesson that must fail, and no
notebook is committed with outputs. (That every starter fails and
teaches and every solution passes is graded once, in tests/test_variants.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from msglab.catalog import NAME_RULE, Lab, all_labs

ROOT = Path(__file__).resolve().parent.parent
LABS = all_labs(ROOT)


def test_there_are_labs_to_audit() -> None:
    assert LABS, "no labs found: the audit would pass vacuously"


@pytest.mark.parametrize("folder", ["lessons", "labs", "solutions"])
def test_names_follow_the_numbering_rule(folder: str) -> None:
    for entry in sorted((ROOT / folder).iterdir()):
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        stem = entry.stem if entry.suffix == ".ipynb" else entry.name
        assert NAME_RULE.match(stem), f"{folder}/{entry.name}: names are NN_words_in_lower_case"


def test_labs_lessons_and_solutions_run_in_parallel() -> None:
    lab_names = {lab.name for lab in LABS}
    assert {p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()} == lab_names
    lessons = {p.stem for p in (ROOT / "lessons").glob("*.ipynb")}
    missing = lab_names - lessons
    assert not missing, f"labs without a lesson of the same name: {sorted(missing)}"


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_lab_has_todos_and_a_solution_file(lab: Lab) -> None:
    starter = (lab.folder / lab.file).read_text()
    todos = re.findall(r"#\s*TODO:\s*(.+)", starter)
    assert todos, f"{lab.name}/{lab.file} has no '# TODO:' line"
    assert all(t.strip().endswith(".") for t in todos), "each TODO is one imperative sentence ending in a period"
    assert lab.source(solution=True).is_file()
    assert (lab.folder / "README.md").is_file(), "each lab folder explains its task"


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_lab_has_a_variant_pasted_from_its_lesson_that_must_fail(lab: Lab) -> None:
    """A PASS must mean the learner transferred the idea: a file built from the lesson's own cells
    (tests/variants/NN_x/from_lesson*.py) fails, and names the checks it fails (tests/test_variants.py
    grades it on its seeds, so the audit stays honest as the lesson changes)."""
    pasted = sorted((ROOT / "tests" / "variants" / lab.name).glob("from_lesson*.py"))
    assert pasted, f"{lab.name} has no tests/variants/{lab.name}/from_lesson*.py built from its lesson's cells"
    for path in pasted:
        assert re.search(r"^\s*Expect:\s*fail\s+\w", path.read_text(), re.M), f"{path.name} must expect to fail"


def test_no_notebook_is_committed_with_outputs() -> None:
    for notebook in sorted(ROOT.glob("*/**/*.ipynb")):
        if ".venv" in notebook.parts or ".ipynb_checkpoints" in notebook.parts:
            continue
        cells = json.loads(notebook.read_text())["cells"]
        dirty = [
            i
            for i, c in enumerate(cells)
            if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))
        ]
        assert not dirty, f"{notebook.relative_to(ROOT)} carries outputs in cells {dirty}: strip them"
