"""Predict, then run: a lesson asks for the learner's guess before an experiment and compares after.

    guess = msglab.predict("Of 200 orders, how many are lost when the worker acks first and crashes 10 times?")
    ...                    # the experiment's cell, which never states the answer
    guess.reveal(result.lost, unit="orders")   # "You said 5; measured 3 orders."

A choice instead of a number: `msglab.predict("Which arrives first?", choices=["A", "B"])`.
The question's source never holds the answer, and a headless run (nbval, CI) records no guess and
says so, so the notebook runs top to bottom without anyone typing.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any


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
        self.answer = answer

    def verdict(self, measured: Any, unit: str = "") -> str:
        """'You said X; measured Y.' as plain text."""
        shown = f"{measured:g}" if isinstance(measured, float) else str(measured)
        shown += f" {unit}" if unit else ""
        if self.answer is None:
            return f"You did not record a prediction; measured {shown}."
        said = f"{self.answer:g}" if isinstance(self.answer, float) else str(self.answer)
        if self.answer == measured:
            return f"You said {said}; measured {shown}. Right."
        return f"You said {said}; measured {shown}."

    def reveal(self, measured: Any, unit: str = "") -> Reveal:
        """Show the learner's answer beside what was measured (the cell's last line displays it)."""
        return Reveal(self.verdict(measured, unit), self.answer is not None and self.answer == measured)

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
    if choices:
        field_ = widgets.RadioButtons(options=list(choices), value=None, layout={"width": "max-content"})
    else:
        field_ = widgets.FloatText(value=None, placeholder="your number", layout={"width": "10em"})
    button = widgets.Button(description="Record my prediction")

    def on_click(_: Any) -> None:
        if field_.value is None:
            said.value = "<i>Type or pick an answer first.</i>"
            return
        prediction.record(field_.value)
        said.value = f"<i>Recorded: {html.escape(str(field_.value))}. Now run the next cell.</i>"

    button.on_click(on_click)
    prediction.widget = widgets.VBox(
        [widgets.HTML(f"<b>Predict:</b> {html.escape(question)}"), widgets.HBox([field_, button]), said],
        layout={"border": "1px solid #d0d7de", "padding": "8px"},
    )
    display(prediction.widget)
    return prediction
