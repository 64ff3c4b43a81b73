"""Interactive controls for the lessons (ipywidgets), thin layers over plumbing a cell can call itself.

Every control's work is an ordinary coroutine (`OrderDesk.fire`, `OrderDesk.set_state`), so a
headless run (nbval, a test) calls the same code without clicking anything.
"""

from __future__ import annotations

import asyncio
import html
from typing import Any

from msglab.demos.request_reply_vs_events import STATES, OrderDesk
from msglab.notebook import charts


class DeskControl:
    """Buttons to take inventory and email up, down or silent, a slider for N, and a 'place N orders' button.

    The chart below them redraws after every change. Display it by making it a cell's last line.
    """

    def __init__(self, desk: OrderDesk) -> None:
        import ipywidgets as w

        self.desk = desk
        self.pending: set[asyncio.Task[None]] = set()
        self._one_at_a_time = asyncio.Lock()  # clicks take effect in the order they were made
        self.toggles = {
            name: w.ToggleButtons(
                options=list(STATES), value=service.state, description=name, style={"button_width": "70px"}
            )
            for name, service in desk.services.items()
        }
        self.n = w.IntSlider(value=10, min=1, max=50, description="orders")
        self.fire_button = w.Button(
            description="Place N orders each way", button_style="primary", layout={"width": "220px"}
        )
        self.status = w.HTML()
        self.image = w.Image(format="png")
        for name, toggle in self.toggles.items():
            toggle.observe(lambda change, name=name: self._spawn(self._set(name, change["new"])), names="value")
        self.fire_button.on_click(lambda _: self._spawn(self._fire()))
        self.widget = w.VBox([*self.toggles.values(), w.HBox([self.n, self.fire_button]), self.status, self.image])

    def _spawn(self, work: Any) -> None:
        # Widget callbacks are plain functions running on the kernel's event loop: schedule the
        # coroutine there and keep a reference, so it is neither collected nor lost.
        task = asyncio.get_running_loop().create_task(work)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _set(self, name: str, state: str) -> None:
        await self._guard(self.desk.set_state(name, state), f"{name} is {state}")

    async def _fire(self) -> None:
        self.fire_button.disabled = True
        try:
            await self._guard(self.desk.fire(self.n.value), f"placed {self.n.value} orders each way")
        finally:
            self.fire_button.disabled = False

    async def _guard(self, work: Any, done: str) -> None:
        """Run one action and redraw; an error shows as a line of text, not a lost traceback."""
        try:
            async with self._one_at_a_time:
                await work
                await self.redraw(done)
        except Exception as exc:  # a closed desk, a stopped server: say so in the panel
            self.status.value = (
                f"<span style='color:#cf222e'>{html.escape(type(exc).__name__)}: "
                f"{html.escape(str(exc))} (re-run the cells above?)</span>"
            )

    async def redraw(self, note: str = "") -> None:
        """Fetch the tally and redraw the chart."""
        tally = await self.desk.tally()
        rr, ev, refused = tally.request_reply, tally.event, tally.refused("request_reply")
        self.status.value = (
            f"{html.escape(note)}. Wait for email: {rr['accepted']} accepted, {refused} refused. "
            f"Events: {ev['accepted']} accepted, {tally.emailed} emailed, {tally.waiting} waiting in the stream."
        )
        self.image.value = charts.png(charts.order_outcomes(tally))

    async def idle(self) -> None:
        """Wait until every click so far has been handled (tests and headless runs)."""
        while self.pending:
            await asyncio.gather(*list(self.pending))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


async def order_desk(desk: OrderDesk) -> DeskControl:
    """The lesson 01 control panel over `desk`, drawn with the desk's current tally."""
    control = DeskControl(desk)
    await control.redraw("ready")
    return control
