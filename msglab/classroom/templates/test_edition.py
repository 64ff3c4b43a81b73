"""This copy of the course works here: every lab's starter, graded on a fresh server, fails and says why.

`make test` runs it after the lessons (which run headless under nbval). A starter that passed would
mean the lab asks for nothing; a failure without a message and a hint would teach nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(path.parent.name for path in ROOT.glob("labs/*/lab.toml"))


@pytest.mark.parametrize("lab", LABS)
def test_the_starter_fails_with_a_teaching_message(lab: str, tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "NATS_URL"}
    env.update(MSGLAB_ROOT=str(ROOT), MSGLAB_STATE_DIR=str(tmp_path))  # your own attempts stay as they are
    done = subprocess.run([sys.executable, "-m", "msglab", "check", lab, "--seed", "1", "--json"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 1, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    verdict = json.loads(done.stdout)
    failed = [check for check in verdict["checks"] if not check["passed"]]
    assert failed, "the starter passes: the lab asks for nothing"
    for check in failed:
        assert check["message"] and check["hint"], check
        assert "Traceback" not in check["message"].splitlines()[0], check
