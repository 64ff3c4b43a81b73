"""A delivery timeline drawn from a real crash run (msglab.demos.delivery_guarantees): who got which delivery, where
each worker was killed, and when the broker redelivered.

    timeline.draw(result)                      # every order
    timeline.draw(result, orders=range(1, 41))  # the first 40, to read it closely

One row per order, time on the x axis. A ring is a delivery, coloured by the worker process that
got it; a dot is a charge; a green tick an ack; a red cross the SIGKILL (with a red line across,
since a whole process dies); a dashed line joins an order's deliveries, so every redelivery is a
line that jumps forward by about ack_wait. Orders never charged are marked "lost", orders
charged again are circled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from msglab.demos.delivery_guarantees import Result


def _number(key: str | None) -> int:
    return int(key.split("-")[1]) if key else 0


def draw(result: Result, orders: Iterable[int] | None = None, title: str | None = None) -> Any:
    """Draw the run as a matplotlib figure (displayed by the notebook) and return it."""
    import matplotlib.pyplot as plt

    shown = set(orders) if orders is not None else set(range(1, result.messages + 1))
    colour = {pid: plt.get_cmap("tab10")(i % 10) for i, pid in enumerate(result.workers)}
    height = min(9.0, 2.5 + 0.06 * len(shown))
    fig, ax = plt.subplots(figsize=(11, height))
    events = [e for e in result.events if e.key is None or _number(e.key) in shown]

    deliveries: dict[int, list[float]] = {}
    for e in events:
        if e.kind == "delivery":
            deliveries.setdefault(_number(e.key), []).append(e.t)
    for row, times in deliveries.items():
        if len(times) > 1:
            ax.plot(times, [row] * len(times), "--", color="0.6", linewidth=0.8, zorder=1)

    def scatter(kind: str, **style: Any) -> None:
        picked = [e for e in events if e.kind == kind and e.key]
        if picked:
            ax.scatter([e.t for e in picked], [_number(e.key) for e in picked], zorder=3, **style)

    for pid in result.workers:
        mine = [e for e in events if e.kind == "delivery" and e.pid == pid]
        if mine:
            ax.scatter([e.t for e in mine], [_number(e.key) for e in mine], s=36, facecolors="none",
                       edgecolors=[colour[pid]], linewidths=1.2, zorder=2)  # fmt: skip
        charged = [e for e in events if e.kind == "charge" and e.pid == pid]
        if charged:
            ax.scatter([e.t for e in charged], [_number(e.key) for e in charged], s=10, color=[colour[pid]], zorder=3)
    scatter("ack", marker="|", s=60, color="#1a7f37")
    for i, crash in enumerate(e for e in result.events if e.kind == "crash"):
        ax.axvline(crash.t, color="#cf222e", alpha=0.25, linewidth=1, zorder=0)
        if _number(crash.key) in shown:
            ax.scatter([crash.t], [_number(crash.key)], marker="X", s=90, color="#cf222e", zorder=4)
        ax.annotate(f"kill {i + 1}", (crash.t, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                    color="#cf222e", ha="center", va="bottom")  # fmt: skip

    charges = result.charges
    for row in sorted(shown):
        key = f"o-{row:03d}"
        if not charges.get(key):
            last = max((e.t for e in events if e.key == key), default=0.0)
            ax.annotate("  lost", (last, row), fontsize=8, color="#cf222e", fontweight="bold", va="center")
        elif charges[key] > 1:
            again = [e.t for e in events if e.kind == "charge" and e.key == key][1:]
            ax.scatter(again, [row] * len(again), s=160, facecolors="none", edgecolors="#bf8700", linewidths=2,
                       zorder=4)  # fmt: skip

    ax.set_xlabel("seconds since the first worker started")
    ax.set_ylabel("order number")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or result.summary(), fontsize=10, pad=14)
    from matplotlib.lines import Line2D

    legend = [
        Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor="0.3", label="delivery"),
        Line2D([], [], marker="o", linestyle="", color="0.3", markersize=4, label="charge"),
        Line2D([], [], marker="|", linestyle="", color="#1a7f37", markersize=9, label="ack"),
        Line2D([], [], marker="X", linestyle="", color="#cf222e", label="SIGKILL"),
        Line2D([], [], linestyle="--", color="0.6", label="redelivery"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="none", markeredgecolor="#bf8700", markersize=10,
               markeredgewidth=2, label="charged again"),
    ]  # fmt: skip
    ax.legend(handles=legend, loc="lower left", fontsize=8, ncol=3)
    fig.tight_layout()
    plt.close(fig)  # the notebook shows the returned figure once, not twice
    return fig
