"""msglab: the plumbing of a hands-on course on reliable messaging with NATS JetStream.

Notebooks call it in one line: `nc, js = await msglab.connect()`, `msglab.check("01")`,
`msglab.hint("01")`, `msglab.progress()`.
Everything heavy (nats, Jupyter, widgets, charts) is imported only where it is used, so the
check path stays fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


async def connect(url: str | None = None) -> tuple[Any, Any]:
    """Connect to the course's server and return (nc, js)."""
    from msglab.broker import connect_js

    return await connect_js(url)


def server_info() -> Any:
    """Where the course's server runs, who started it, and its version."""
    from msglab.broker import server_info as info

    return info()


def check(lab: str, *, solution: bool = False, seed: int | None = None, attempt: bool = True) -> Any:
    """Grade a lab from a notebook; the verdict renders as rich output (`attempt=False`: a demonstration)."""
    from msglab.notebook import check as notebook_check

    return notebook_check(lab, solution=solution, seed=seed, attempt=attempt)


def hint(lab: str) -> Any:
    """The hints open for the checks that failed in your last check of a lab (as `msglab hint NN`)."""
    from msglab.notebook import hint as notebook_hint

    return notebook_hint(lab)


def progress() -> Any:
    """Every lab: passed or not, when it first passed and with which seed, attempts (an HTML table)."""
    from msglab.notebook import progress as notebook_progress

    return notebook_progress()


async def playground(lab: str, solution: bool = False) -> tuple[Any, Any]:
    """Return (env, your lab module) to try your lab code by hand; see msglab.notebook.tryout."""
    from msglab.notebook.tryout import playground as make

    return await make(lab, solution)


async def playground_close(env: Any) -> None:
    """Delete what msglab.playground created and close its connection."""
    from msglab.notebook.tryout import close

    await close(env)


def predict(question: str, choices: list[str] | None = None) -> Any:
    """Ask for the learner's guess before an experiment; `.reveal(measured)` compares after it."""
    from msglab.notebook.predict import predict as ask

    return ask(question, choices)
