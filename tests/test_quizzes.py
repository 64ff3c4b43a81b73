"""The course's quizzes, read as a learner guessing would read them: a right answer must not be findable
by its place in the list or by its length. Counted over every lesson's quiz together."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from msglab.notebook.quiz import Q

LESSONS = sorted((Path(__file__).resolve().parent.parent / "lessons").glob("*.ipynb"))


def course_questions() -> list[tuple[str, Q]]:
    """(lesson, question) for every quiz question in the course, read from the quiz cells' data."""
    found = []
    for lesson in LESSONS:
        for cell in json.loads(lesson.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "quiz([" not in source:
                continue
            namespace: dict[str, Any] = {}
            exec(source.replace("quiz([", "questions = ([", 1), namespace)  # the data, not the widget
            found += [(lesson.stem, q) for q in namespace["questions"]]
    return found


def right_index(question: Q) -> int:
    return next(i for i, a in enumerate(question.answers) if a.correct)


def test_the_course_has_quizzes_to_count() -> None:
    lessons = {lesson for lesson, _ in course_questions()}
    assert lessons == {p.stem for p in LESSONS} and len(course_questions()) >= 4 * len(LESSONS)


def test_no_answer_position_is_right_in_40_percent_of_questions_or_more() -> None:
    questions = course_questions()
    positions = Counter(right_index(q) + 1 for _, q in questions)
    worst, count = positions.most_common(1)[0]
    assert count < 0.4 * len(questions), f"option {worst} is right in {count} of {len(questions)}: {dict(positions)}"


def test_the_right_answer_is_the_longest_option_in_at_most_half_of_the_questions() -> None:
    questions = course_questions()
    longest = [
        f"{lesson}: {q.prompt[:60]}"
        for lesson, q in questions
        if len(q.answers[right_index(q)].text) == max(len(a.text) for a in q.answers)
    ]
    assert len(longest) <= len(questions) / 2, f"{len(longest)} of {len(questions)}:\n" + "\n".join(longest)
