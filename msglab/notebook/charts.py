"""Charts for the lessons, drawn from numbers measured in the run.

Each function returns a matplotlib Figure: the last line of a cell displays it, and
`png(fig)` turns it into bytes for a widget. Figures are closed in pyplot at once, so a chart
shows once, where the cell puts it, and a loop of charts does not pile up open figures.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

GOOD, BAD, SLOW, WAIT, GREY = "#1a7f37", "#cf222e", "#bf8700", "#0969da", "#8c959f"


def _figure(width: float = 7.0, height: float = 3.2, ncols: int = 1) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained")
    plt.close(fig)  # shown by the cell that returns it, not again at the end of the cell
    return fig, axes


def png(fig: Any) -> bytes:
    """The figure as PNG bytes (for an ipywidgets Image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def latency_by_hops(runs: Sequence[Any], work: float = 0.0) -> Any:
    """Median latency of a call through 1, 2, 3 services, each bar marked with what its hop added."""
    fig, ax = _figure()
    hops = [run.hops for run in runs]
    total = [run.median_ms for run in runs]
    worked = [h * work * 1000 for h in hops]
    if work:
        ax.bar(hops, worked, color=GREY, label=f"services' own work ({work * 1000:.0f} ms each)")
    ax.bar(
        hops,
        [t - w for t, w in zip(total, worked, strict=True)],
        bottom=worked,
        color=WAIT,
        label="request-reply round trips",
    )
    for i, (h, t) in enumerate(zip(hops, total, strict=True)):
        added = f"\n(+{t - total[i - 1]:.2f} ms)" if i else ""
        ax.annotate(f"{t:.2f} ms{added}", (h, t), ha="center", va="bottom", fontsize=9)
    ax.set(
        xlabel="services in the chain (hops)",
        ylabel="median latency, ms",
        xticks=hops,
        title="The caller waits for every hop, added up",
    )
    ax.set_ylim(0, max(total) * 1.3)
    ax.legend(loc="upper left", frameon=False)
    return fig


def downtime_by_hops(runs: Sequence[Any], p: float) -> Any:
    """Failed calls per chain length: one dot per seed, the pooled share, 1 - p**hops, and a 'tenfold' line."""
    fig, ax = _figure()
    hops = sorted({run.hops for run in runs})
    tenfold = 10 * (1 - p) * 100
    for h in hops:
        mine = [run for run in runs if run.hops == h]
        xs = [h + 0.06 * (i - (len(mine) - 1) / 2) for i in range(len(mine))]
        ax.scatter(xs, [run.downtime * 100 for run in mine], color=BAD, alpha=0.6, s=22,
                   label="measured, one dot per seed" if h == hops[0] else None)  # fmt: skip
        pooled = sum(run.failed for run in mine) / sum(run.calls for run in mine)
        ax.hlines(pooled * 100, h - 0.25, h + 0.25, color=BAD, linewidth=2,
                  label="measured, all seeds together" if h == hops[0] else None)  # fmt: skip
        ax.annotate(f"{pooled:.2%}", (h + 0.27, pooled * 100), va="center", fontsize=8, color=BAD)
    ax.plot(hops, [(1 - p**h) * 100 for h in hops], "D", color="black", markersize=5, label="1 - p**hops")
    ax.axhline(tenfold, color=GREY, linestyle="--")
    ax.annotate("'tenfold': ten times one service's downtime", (hops[0] - 0.4, tenfold), xytext=(0, 4),
                textcoords="offset points", color=GREY, fontsize=8)  # fmt: skip
    ax.set(
        xlabel="services in the chain (hops)",
        ylabel="failed calls, %",
        xticks=hops,
        title=f"Each service up {p:.1%} of calls, failures drawn at random",
    )
    ax.set_xlim(hops[0] - 0.6, hops[-1] + 0.6)
    ax.set_ylim(0, tenfold * 1.15)
    ax.legend(loc="center left", frameon=False, fontsize=8)
    return fig


def queue_depth(depths: Sequence[int], title: str = "Queue depth while the worker drains the burst") -> Any:
    """Messages waiting on a durable after each batch the worker handled."""
    fig, ax = _figure(height=2.6)
    ax.step(range(len(depths)), depths, where="post", color=WAIT)
    ax.fill_between(range(len(depths)), depths, step="post", color=WAIT, alpha=0.2)
    ax.set(xlabel="batches fetched and acked", ylabel="messages waiting", title=title)
    ax.set_ylim(0, max(depths) * 1.1 or 1)
    return fig


def _stacked(ax: Any, counts: dict[str, Any], title: str) -> None:
    """One bar per way of placing orders, stacked by outcome."""
    outcomes = ["accepted", *sorted({o for c in counts.values() for o in c if o != "accepted"})]
    colours = {"accepted": GOOD}
    bottoms = [0] * len(counts)
    for outcome in outcomes:
        values = [c[outcome] for c in counts.values()]
        colour = colours.get(outcome, SLOW if "timed out" in outcome else BAD)
        hatch = "//" if outcome.startswith("inventory") else None
        ax.bar(list(counts), values, bottom=bottoms, color=colour, hatch=hatch, label=outcome, edgecolor="white")
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set(title=title, ylabel="orders")
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.22), frameon=False, fontsize=8)


def order_outcomes(tally: Any) -> Any:
    """The order desk so far: orders accepted or refused each way, and what became of the events."""
    fig, (left, right) = _figure(width=8.0, height=4.0, ncols=2)
    _stacked(
        left, {"wait for email\n(request-reply)": tally.request_reply, "publish an event": tally.event}, "Orders placed"
    )
    right.bar(["emailed", "waiting in\nthe stream"], [tally.emailed, tally.waiting], color=[GOOD, WAIT])
    right.set(title="Event path: the emails", ylabel="orders")
    states = ", ".join(f"{name} {state}" for name, state in tally.states.items())
    fig.suptitle(f"now: {states}" if states else "", fontsize=9, color=GREY)
    return fig
