"""Predict, then run: a lesson asks for the learner's guess before an experiment and compares after.

    guess = msglab.predict("Of 200 orders, how many are lost when the worker acks first and crashes 10 times?")
    ...                    # the experiment's cell, which never states the answer
    guess.reveal(result.lost, unit="orders")   # "You said 5; measured 3 orders."

A choice instead of a number: `msglab.predict("Which arrives first?", choices=["A", "B"])`, then
`guess.reveal(measured, choice="A")` names the choice the measurement bears out (without
`choice`, the measurement itself is matched against the choices as text).
The question's source never holds the answer, and a headless run (nbval, CI) records no guess and
says so, so the notebook runs top to bottom without anyone typing.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _with_unit(value: Any, unit: str) -> str:
    """'3 orders', '1 order', '2.9 times as often', '1 time as often'."""
    if not unit:
        return _shown(value)
    first, _, rest = unit.partition(" ")
    if value == 1 and first.endswith("s") and not first.endswith("ss"):
        first = first[:-1]
    return f"{_shown(value)} {first}" + (f" {rest}" if rest else "")


def parse_number(text: str) -> float | None:
    """The number a learner typed ('3', '2.5', '1,000', '0.3 %'), or None if it is not one."""
    cleaned = text.strip().replace(",", "").rstrip("%").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


@dataclass
class Prediction:
    """One question, the learner's recorded answer (None until recorded), and the widget that asks it."""

    question: str
    choices: list[str] | None = None
    answer: float | str | None = None
    widget: Any = field(default=None, repr=False)

    def record(self, answer: float | str) -> None:
        """Record an answer (the widget's button does this; tests and scripts may too)."""
        if self.choices is not None and answer not in self.choices:
            raise ValueError(f"{answer!r} is not one of {self.choices}")
        if self.choices is None and not isinstance(answer, int | float):
            number = parse_number(str(answer))
            if number is None:
                raise ValueError(f"{answer!r} is not a number")
            answer = number
        self.answer = answer

    def is_right(self, measured: Any, choice: str | None = None) -> bool:
        """Whether the recorded answer is what was measured (or the choice the measurement bears out)."""
        if self.answer is None:
            return False
        if self.choices is not None:
            return self.answer == (choice if choice is not None else str(measured))
        try:
            return float(self.answer) == float(measured)
        except (TypeError, ValueError):
            return False

    def verdict(self, measured: Any, unit: str = "", choice: str | None = None) -> str:
        """'You said X; measured Y.' as plain text."""
        shown = _with_unit(measured, unit)
        if choice is not None and choice != str(measured):
            shown += f" ({choice})"
        if self.answer is None:
            return f"You did not record a prediction; measured {shown}."
        said = _shown(self.answer)
        if self.is_right(measured, choice):
            return f"You said {said}; measured {shown}. Right."
        return f"You said {said}; measured {shown}."

    def reveal(self, measured: Any, unit: str = "", *, choice: str | None = None) -> Reveal:
        """Show the learner's answer beside what was measured (the cell's last line displays it)."""
        if choice is not None and self.choices is not None and choice not in self.choices:
            raise ValueError(f"{choice!r} is not one of {self.choices}")
        return Reveal(self.verdict(measured, unit, choice), self.is_right(measured, choice))

    def _repr_html_(self) -> str:  # without ipywidgets (a plain HTML export) the question still shows
        return f"<div><b>Predict:</b> {html.escape(self.question)}</div>"


@dataclass(frozen=True)
class Reveal:
    """The comparison, rendered."""

    text: str
    right: bool

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.right else "#0969da"
        return f"<div style='border-left:4px solid {colour};padding-left:8px'>{html.escape(self.text)}</div>"


def predict(question: str, choices: list[str] | None = None) -> Any:
    """Ask for a number (or one of `choices`) before an experiment; returns the Prediction, shown as a widget."""
    prediction = Prediction(question, list(choices) if choices else None)
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        return prediction
    said = widgets.HTML()
    field_: Any
    if choices:
        field_ = widgets.RadioButtons(options=list(choices), value=None, layout={"width": "max-content"})
    else:  # text, not a number field: an empty number field reads as 0, and 0 is often the answer
        field_ = widgets.Text(value="", placeholder="your number", layout={"width": "10em"})
    button = widgets.Button(description="Record my prediction")

    def on_click(_: Any) -> None:
        value = field_.value
        if value is None or value == "":
            said.value = "<i>Type or pick an answer first.</i>"
            return
        try:
            prediction.record(value)
        except ValueError:
            said.value = "<i>That is not a number: type one, such as 3 or 0.5.</i>"
            return
        said.value = f"<i>Recorded: {html.escape(_shown(prediction.answer))}. Now run the next cell.</i>"

    button.on_click(on_click)
    prediction.widget = widgets.VBox(
        [widgets.HTML(f"<b>Predict:</b> {html.escape(question)}"), widgets.HBox([field_, button]), said],
        layout={"border": "1px solid #d0d7de", "padding": "8px"},
    )
    display(prediction.widget)
    return prediction
