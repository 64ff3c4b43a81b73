"""The learner edition's own `make test`, run in the edition, in a fresh venv: green.

The venv is new (`python -m venv`), the edition installed into it (editable, as its Makefile does);
to stay fast and offline, the packages come from this checkout's venv through a path file instead
of a download (the same pinned versions: the edition's pyproject.toml is the course's). Its
Makefile's install steps are the course's own (`make lab` is tested in test_make_lab.py), so their
stamps are set and `make test` runs the edition's test command itself: here lesson 00 and lab 01's
notebook under nbval (every other notebook is the instructor's byte for byte, which the suite runs) and
a lab's starter failing with a teaching message (one lab a quick run, another each commit; every lab a
deep one). About 30 s on 2 cores, idle.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import venv
from pathlib import Path

from verdicts import DEPTH, one_this_round

from conftest import ROOT
from msglab.broker.server import find_server_binary
from msglab.catalog import all_labs
from msglab.classroom.edition import build_edition


def test_the_editions_make_test_is_green_in_a_fresh_venv(tmp_path: Path, no_nats_url: None) -> None:
    edition = tmp_path / "msglab-learners"
    build_edition(edition, ROOT, strict=False, allow_dirty=True, git=True)
    fresh = edition / ".venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = str(fresh / "bin" / "python")
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True).stdout.strip())
    # This checkout's packages (its own msglab is not among them: an editable install's finder lives in a
    # .pth file, and .pth files of a directory named in a .pth file are not read), then the edition itself,
    # installed editable as a path (what `pip install -e .` amounts to, without building a wheel).
    (site / "00-course-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (site / "01-msglab-edition.pth").write_text(f"{edition}\n")
    where = subprocess.run([python, "-c", "import msglab; print(msglab.__file__)"],
                           capture_output=True, text=True, check=True, cwd="/")  # fmt: skip
    assert where.stdout.strip() == str(edition / "msglab" / "__init__.py"), "the edition's own msglab"
    for stamp in (".msglab-runtime", ".msglab-test-tools"):  # in make's order: the runtime first
        (fresh / stamp).touch()
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "MSGLAB_ROOT", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(NATS_SERVER_BIN=find_server_binary().path, MSGLAB_STATE_DIR=str(tmp_path / "state"))
    # The edition grades its starters one after another: a quick run (verdicts.DEPTH) has it grade one, another
    # lab each commit (the same starters are graded in this suite's own tests), a deep run every one.
    labs = [lab.name for lab in all_labs(edition)]
    starters = one_this_round(labs)
    lab_notebook = sorted(edition.glob("labs/*/lab.ipynb"))[0].relative_to(edition)
    tests = f"lessons/00_setup_and_first_contact.ipynb {lab_notebook} tests/test_edition.py"
    if DEPTH != "deep":
        tests += f" -k '{starters[0]} or ipynb'"
    done = subprocess.run(["make", "test", f"TESTS={tests}"],
                          cwd=edition, capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) > len(starters), done.stdout[-2000:]  # the starters and cells
    assert "failed" not in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
    assert "ruff" not in done.stdout + done.stderr
