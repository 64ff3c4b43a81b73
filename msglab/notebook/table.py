"""A small table for a cell's last line: plain text in a terminal or nbval, HTML in JupyterLab."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Table:
    """Rows shown as text or HTML."""

    head: list[str]
    rows: list[list[Any]]

    def __repr__(self) -> str:
        widths = [max(len(str(x)) for x in [h, *(r[i] for r in self.rows)]) for i, h in enumerate(self.head)]
        lines = ["  ".join(str(h).ljust(w) for h, w in zip(self.head, widths, strict=True))]
        lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)) for r in self.rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in self.head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"
