"""Try a lab's code by hand from its notebook, before the grader judges it.

`env, lab = await msglab.playground("01")` imports your lab file afresh, connects to the course's
server, lets the lab's grader set up what the platform provides (streams, durables) under names
of their own, and gives env effects that print what they do instead of recording them.
"""

from __future__ import annotations

import importlib
import secrets
from types import ModuleType
from typing import Any

from msglab.broker import connect_js, delete_streams
from msglab.catalog import find_lab
from msglab.grading.labkit import LabEnv, Names
from msglab.grading.runner import load_learner


async def playground(key: str, solution: bool = False) -> tuple[LabEnv, ModuleType]:
    """Return (env, your lab module), ready to call, e.g. `await lab.place_order(env, order)`."""
    lab = find_lab(key)
    grader = importlib.import_module(lab.grader_module)
    learner = load_learner(str(lab.source(solution)))
    nc, js = await connect_js()
    env = LabEnv(nc, js, Names("try" + secrets.token_hex(2)), dict(getattr(grader, "PARAMS", {})))
    await grader.playground(env)
    return env, learner


async def close(env: Any) -> None:
    """Delete what the playground created and close its connection."""
    for undo in getattr(env, "on_close", []):  # what a grader's playground made besides streams (a folder)
        undo()
    await delete_streams(env.js, env.names.stream(""))
    await env.nc.close()
