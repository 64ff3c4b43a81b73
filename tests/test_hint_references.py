"""A hint's level-2 `lesson = "..."` names sections of a lesson that exist: every 'quoted' title in it
is a heading of the lab's lesson (or of `lesson NN` where the text starts by naming another one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from msglab.catalog import Lab, all_labs

ROOT = Path(__file__).resolve().parent.parent
QUOTED = re.compile(r"(?:(?<=\s)|^)'([^']+)'(?=[\s,;:.)]|$)")
ASIDE = re.compile(r"\s\([^)]*\)")  # a parenthesis quotes the lesson's words, not its headings
OTHER_LESSON = re.compile(r"^lesson (\d\d)\b")


def normal(title: str) -> str:
    """A title as a reader compares it: no markdown, no leading section number, one space, lower case."""
    title = re.sub(r"^#+\s*", "", title).replace("`", "").replace("*", "")
    return re.sub(r"\s+", " ", re.sub(r"^\d+\.\s*", "", title)).strip().lower()


def headings(lesson: Path) -> set[str]:
    cells = json.loads(lesson.read_text())["cells"]
    lines = ("".join(c["source"]).splitlines() for c in cells if c["cell_type"] == "markdown")
    return {normal(line) for cell in lines for line in cell if line.startswith("#")}


def titles_in(text: str) -> list[str]:
    return QUOTED.findall(ASIDE.sub("", text))


def lesson_of(lab: Lab, text: str) -> Path:
    other = OTHER_LESSON.match(text)
    if other:
        found = sorted((ROOT / "lessons").glob(f"{other.group(1)}_*.ipynb"))
        assert found, f"lab {lab.number}: the hint names lesson {other.group(1)}, which does not exist"
        return found[0]
    return ROOT / lab.lesson


@pytest.mark.parametrize("lab", all_labs(), ids=lambda lab: lab.number)
def test_every_lesson_reference_of_a_hint_names_a_heading_that_exists(lab: Lab) -> None:
    missing = []
    for check, hint in lab.hints.items():
        if not hint.lesson:
            continue
        lesson = lesson_of(lab, hint.lesson)
        titles = headings(lesson)
        missing += [
            f"[hints.{check}] '{q}' in {lesson.name}" for q in titles_in(hint.lesson) if normal(q) not in titles
        ]
    assert not missing, "lesson references to headings that do not exist:\n  " + "\n  ".join(missing)


def test_the_reference_reader_finds_quoted_titles_and_skips_apostrophes() -> None:
    text = "section 2, 'Backoff, and a budget' (o-1043), and section 3, 'A dead-letter queue, two ways'; lesson 02's"
    assert titles_in(text + " (zero rows means 'done before')") == [
        "Backoff, and a budget",
        "A dead-letter queue, two ways",
    ]
    assert normal("## 4. The timer: `ack_wait`") == normal("The timer: ack_wait")
