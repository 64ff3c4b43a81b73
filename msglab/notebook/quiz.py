"""Auto-checked quizzes for lessons: each question a set of choices, each choice its own feedback.

    quiz([
        Q("A customer clicks 'Pay'. Request-reply or event?",
          [A("request-reply", True, "Right: the screen needs the answer now."),
           A("event", False, "The customer waits for this answer; an event gives none.")]),
    ])

`grade_answers` is the same logic without widgets, so tests and headless runs can check a quiz.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class A:
    """One answer: its text, whether it is right, and the feedback that teaches why."""

    text: str
    correct: bool
    feedback: str


@dataclass(frozen=True)
class Q:
    """One question and its answers."""

    prompt: str
    answers: list[A]

    def __post_init__(self) -> None:
        if not any(a.correct for a in self.answers):
            raise ValueError(f"question has no right answer: {self.prompt}")


def grade_answers(questions: list[Q], picks: list[int]) -> tuple[int, list[str]]:
    """Score picks (one answer index per question); return (right count, feedback lines)."""
    right, feedback = 0, []
    for question, pick in zip(questions, picks, strict=True):
        answer = question.answers[pick]
        right += answer.correct
        feedback.append(("✔ " if answer.correct else "✘ ") + answer.feedback)
    return right, feedback


def quiz(questions: list[Q]) -> Any:
    """Display the questions as ipywidgets; each answer shows its feedback when picked."""
    import ipywidgets as widgets

    boxes = []
    for number, question in enumerate(questions, 1):
        out = widgets.HTML()
        choice = widgets.RadioButtons(
            options=[a.text for a in question.answers], value=None, layout={"width": "max-content"}
        )

        def on_pick(change: dict[str, Any], question: Q = question, out: Any = out) -> None:
            answer = next(a for a in question.answers if a.text == change["new"])
            colour = "#1a7f37" if answer.correct else "#cf222e"
            mark = "Right." if answer.correct else "Not quite."
            out.value = f"<span style='color:{colour}'><b>{mark}</b> {answer.feedback}</span>"

        choice.observe(on_pick, names="value")
        boxes.append(widgets.VBox([widgets.HTML(f"<b>{number}. {question.prompt}</b>"), choice, out]))
    return widgets.VBox(boxes, layout={"border": "1px solid #d0d7de", "padding": "8px"})
