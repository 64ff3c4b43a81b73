"""A real browser runs every lesson in the course's own JupyterLab, as a learner would after `make lab`.

A deep run (verdicts.DEPTH) takes every lesson; a quick one (`make test`) exactly one, another each commit,
and nbval runs the others headless (conftest.py), so every run executes every lesson.

One JupyterLab (started by msglab.jupyter, as `make lab` does, but with throwaway config, runtime,
settings and workspace folders) and one real nats-server serve every lesson. Debian's Chromium,
driven by Playwright, opens each lesson, runs all cells and checks what a learner would see:
no error output, every displayed widget rendered, no JavaScript error on the page. On the way it clicks as
a learner does: it records an answer to the lesson's first prediction before that experiment runs (and
checks that the reveal compares it with what was measured) and answers the first quiz question, once
wrongly and once rightly (and checks each shows its own feedback).
A screenshot per lesson lands in var/screenshots/ for a person to look at after the run.
Without /usr/bin/chromium or Playwright the tests skip (Playwright cannot download a browser here).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from verdicts import in_this_round, one_this_round

from msglab.broker.server import EmbeddedServer
from msglab.jupyter import LabProcess, free_port, lab_command, lab_env, start_lab, write_settings

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic",
]  # fmt: skip
SCREENSHOTS = ROOT / "var" / "screenshots"
SELFTEST = ROOT / "var" / "browser-selftest"  # inside the course root, so JupyterLab can open it
LESSONS = one_this_round(sorted((ROOT / "lessons").glob("*.ipynb")))
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
READY_TIMEOUT_MS = 120_000  # a kernel's first start on a busy 2-core machine
RUN_TIMEOUT_MS = 240_000  # a whole lesson, grader runs included; pytest-timeout is the outer bound

# Reads the open notebook from JupyterLab itself (window.jupyterapp): for each code cell its source, execution
# count and outputs as the kernel sent them (the model), each next to what the page shows for it (the DOM node
# the output area made for that output, in the same order).
STATE_JS = """
() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code').map(c => {
    const views = c.outputArea ? c.outputArea.widgets : [];
    return {
      source: c.model.sharedModel.getSource(),
      tags: c.model.getMetadata('tags') || [],
      count: c.model.executionCount,
      running: c.model.executionState === 'running',
      outputs: c.model.outputs.toJSON().map((o, i) => {
        const node = views[i] ? views[i].node : null;
        return {
          type: o.output_type,
          ename: o.ename || null,
          evalue: o.evalue || null,
          mimes: Object.keys(o.data || {}),
          text: typeof o.text === 'string' ? o.text : (Array.isArray(o.text) ? o.text.join('') : ''),
          shown: node ? node.textContent.slice(0, 300) : null,
          widgets: node ? node.querySelectorAll('.jupyter-widgets').length : 0,
          // Tracebacks render as stderr text, so a traceback is told apart by its words.
          traceback: node ? Array.from(node.querySelectorAll('[data-mime-type="application/vnd.jupyter.stderr"]'))
            .some(n => /Traceback|Error:/.test(n.textContent)) : false,
        };
      }),
    };
  });
  return {
    path: panel.context.path,
    kernel: kernel ? kernel.status : null,
    dialogs: Array.from(document.querySelectorAll('.jp-Dialog')).map(d => d.innerText),
    news: document.body.innerText.includes('official Jupyter news'),
    cells,
  };
}
"""
# A run has settled: kernel idle, no cell running or still waiting its turn (Run All stops at the first
# error), and every widget view drawn or failed: views render asynchronously, after their cell has finished.
# `upto` (a code cell's index, or null for all) limits the cells that must have run.
SETTLED_JS = f"""
(upto) => {{
  const s = ({STATE_JS})();
  if (!s || s.kernel !== 'idle' || s.cells.some(c => c.running)) return false;
  const cells = upto === null ? s.cells : s.cells.slice(0, upto + 1);
  const failed = cells.some(c => !c.tags.includes('raises-exception') && c.outputs.some(o => o.type === 'error'));
  if (!failed && cells.some(c => c.source.trim() && c.count === null)) return false;
  return cells.every(c => c.outputs.every(o => !o.mimes.includes('{WIDGET_MIME}')
    || ((o.widgets > 0 || (o.shown || '').trim() !== '') && !(o.shown || '').includes('Loading widget'))));
}}
"""
# Runs a notebook command with cell `i` (an index among all cells) active; its promise settles in window.__msglabRun.
COMMAND_JS = """
([command, i]) => { window.__msglabRun = null;
  const p = window.jupyterapp.shell.currentWidget;
  if (i !== null) p.content.activeCellIndex = i;
  window.jupyterapp.commands.execute(command).then(
    ok => { window.__msglabRun = {ok: ok}; }, err => { window.__msglabRun = {error: String(err)}; }); }
"""
# Names cell i's output area for the page's locators, and scrolls it into view (a windowed notebook may not
# have drawn a cell far below).
MARK_JS = """
async ([i, name]) => {
  const p = window.jupyterapp.shell.currentWidget;
  p.content.activeCellIndex = i;
  if (p.content.scrollToItem) { try { await p.content.scrollToItem(i, 'center'); } catch (e) {} }
  p.content.widgets[i].outputArea.node.setAttribute('data-msglab', name);
}
"""


@dataclass
class Course:
    """The running course: JupyterLab, its NATS server, and a browser."""

    lab: LabProcess
    server: EmbeddedServer
    browser: Any


@dataclass
class LessonRun:
    """What one notebook looked like after Run All."""

    state: dict[str, Any] = field(default_factory=dict)
    page_errors: list[str] = field(default_factory=list)
    unfinished: str = ""  # why waiting for Run All to settle gave up, if it did
    clicks: list[str] = field(default_factory=list)  # what the learner's clicks showed that they should not
    revealed: str = ""  # the reveal after the recorded prediction, as the page shows it

    def problems(self) -> list[str]:
        """Everything a learner would see as broken, one line each; empty when the lesson is fine."""
        found = [f"JavaScript error on the page: {err}" for err in self.page_errors] + self.clicks
        if self.unfinished:
            found.append(self.unfinished)
        found += [f"a dialog is open: {text!r}" for text in self.state["dialogs"]]
        if self.state["news"]:
            found.append("the 'Jupyter news' pop-up is showing")
        for n, cell in enumerate(self.state["cells"], 1):
            where = f"code cell {n} ({_first_line(cell['source'])!r})"
            if cell["running"]:
                found.append(f"{where} was still running")
            elif cell["source"].strip() and cell["count"] is None:
                found.append(f"{where} never ran")
            # A cell tagged raises-exception shows an error on purpose (Run All and nbval go on past it).
            expected = "raises-exception" in cell["tags"]
            for out in cell["outputs"]:
                if expected and (out["type"] == "error" or out["traceback"]):
                    pass
                elif out["type"] == "error":
                    found.append(f"{where} raised {out['ename']}: {out['evalue']}")
                elif out["traceback"]:
                    found.append(f"{where} shows a traceback: {_first_line(out['text'] or out['shown'] or '')!r}")
                if WIDGET_MIME in out["mimes"] and not _widget_drawn(out):
                    found.append(f"{where}: a widget did not render (the page shows {(out['shown'] or '').strip()!r})")
        return found

    def widget_outputs(self) -> int:
        """How many widget views the kernel displayed (from the outputs' mime types)."""
        return sum(WIDGET_MIME in out["mimes"] for cell in self.state["cells"] for out in cell["outputs"])

    def rendered_widgets(self) -> int:
        """How many of them the page shows as drawn widgets."""
        return sum(WIDGET_MIME in o["mimes"] and _widget_drawn(o) for c in self.state["cells"] for o in c["outputs"])


def _widget_drawn(out: dict[str, Any]) -> bool:
    # ipywidgets draws its own failure notices inside a .jupyter-widgets node too: read the words as well.
    shown = out["shown"] or ""
    return out["widgets"] > 0 and "Error displaying widget" not in shown and "Loading widget" not in shown


def _first_line(source: str) -> str:
    lines = [line for line in source.splitlines() if line.strip()]
    return lines[0][:60] if lines else ""


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Course]:
    """The course's JupyterLab on a free loopback port, its own nats-server, and headless Chromium."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM} (install Debian's chromium to run the browser tests)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    tmp = tmp_path_factory.mktemp("jupyter")
    base = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "MSGLAB_ROOT")}
    # Throwaway user folders: a developer's own Jupyter config, settings and workspaces must not change
    # what the test sees, and the test must leave none behind. The installed JupyterLab (assets, widget
    # extension, kernelspec under sys.prefix) is still found: those are not user folders.
    for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_DATA_DIR", "data"),
                     ("JUPYTERLAB_SETTINGS_DIR", "user-settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                     ("IPYTHONDIR", "ipython")]:  # fmt: skip
        (tmp / sub).mkdir()
        base[var] = str(tmp / sub)
    port, token = free_port(), secrets.token_urlsafe(16)
    # Never write into the course: no autosave of executed lessons, checkpoints kept in tmp.
    settings = write_settings(tmp / "settings", extra={"@jupyterlab/docmanager-extension:plugin": {"autosave": False}})
    command = lab_command(port=port, token=token, root=ROOT, settings_dir=settings)
    command += [
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: read cells, run commands
        f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}",  # absolute: one folder outside the course
    ]
    with EmbeddedServer() as server:
        env = lab_env(server.url, server.version, f"{server.binary.source}: {server.binary.path}", base=base)
        lab = start_lab(command, env, port, token, log_path=tmp / "jupyterlab.log")
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
                try:
                    yield Course(lab, server, browser)
                finally:
                    browser.close()
        finally:
            lab.stop()


@dataclass(frozen=True)
class Clicks:
    """Where a learner clicks in one lesson: its first prediction, that prediction's reveal, its quiz."""

    predict: int  # index among all cells
    predict_code: int  # the same cell's index among code cells
    reveal: int  # index among code cells (as STATE_JS lists them)
    quiz: int  # index among all cells
    wrong: Any  # the first question's first wrong answer, and its right one (msglab.notebook.quiz.A)
    right: Any

    @classmethod
    def of(cls, notebook: Path) -> Clicks:
        from msglab.notebook.quiz import Q

        cells = json.loads(notebook.read_text())["cells"]
        sources = ["".join(c["source"]) for c in cells]
        code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
        predict = next(i for i in code if "msglab.predict(" in sources[i])
        reveal = next(n for n, i in enumerate(code) if i > predict and ".reveal(" in sources[i])
        quiz = next(i for i in code if "quiz([" in sources[i])
        namespace: dict[str, Any] = {}
        exec(sources[quiz].replace("quiz([", "questions = ([", 1), namespace)  # the data, not the widget
        first: Q = namespace["questions"][0]
        wrong = next(a for a in first.answers if not a.correct)
        right = next(a for a in first.answers if a.correct)
        return cls(predict, code.index(predict), reveal, quiz, wrong, right)


def run_notebook(course: Course, path: str, screenshot: Path, clicks: Clicks | None = None) -> LessonRun:
    """Open notebook `path` (relative to the course root) in a fresh workspace, Run All, and read the result.

    With `clicks`: run the cells up to the first prediction, record an answer in its widget, run the rest,
    then answer the quiz's first question wrongly and rightly; what the page showed wrong lands in `clicks`."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = course.browser.new_page(viewport={"width": 1400, "height": 1000})
    run = LessonRun()
    page.on("pageerror", lambda exc: run.page_errors.append(str(exc)))
    try:
        # A workspace per notebook: nothing restored from an earlier one, one kernel at a time.
        page.goto(course.lab.url(f"lab/workspaces/t{secrets.token_hex(4)}/tree/{path}"))
        # Run All before the kernel is ready brings up a kernel dialog instead of running anything.
        try:
            page.wait_for_function(
                """(path) => {
                  const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                  return !!(p && p.context && p.context.path === path && p.sessionContext && p.sessionContext.isReady
                            && p.sessionContext.session && p.sessionContext.session.kernel
                            && p.sessionContext.session.kernel.status === 'idle');
                }""",
                arg=path, timeout=READY_TIMEOUT_MS,
            )  # fmt: skip
        except PlaywrightTimeout:
            pytest.fail(f"{path}: no idle kernel after {READY_TIMEOUT_MS // 1000} s (page errors: {run.page_errors})")
        said = ""
        if clicks is None:  # the learner's gesture, Run > Run All Cells; its promise settles when the last cell has run
            _run(page, run, "runmenu:run-all", None, None)
        else:  # the cells up to the prediction, an answer recorded, then the rest
            if _run(page, run, "notebook:run-all-above", clicks.predict + 1, clicks.predict_code):
                said = _record_prediction(page, run, clicks.predict)
                _run(page, run, "notebook:run-all-below", clicks.predict + 1, None)
        run.state = page.evaluate(STATE_JS)
        if clicks is not None and not run.unfinished:
            _check_reveal(run, clicks.reveal, said)
            _answer_quiz(page, run, clicks)
        return run
    finally:
        # Whatever happened, a picture of it; then shut the kernel down: the next lesson gets the CPU to itself.
        # (A failure here must not hide the one that brought us here.)
        with contextlib.suppress(PlaywrightError):
            _screenshot(page, screenshot)
        with contextlib.suppress(PlaywrightError):
            page.evaluate("() => window.jupyterapp && window.jupyterapp.serviceManager.sessions.shutdownAll()")
        page.close()


def _run(page: Any, run: LessonRun, command: str, active: int | None, upto: int | None) -> bool:
    """Run a notebook command and wait until the cells it ran have settled; False (and why) if they did not."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.evaluate(COMMAND_JS, [command, active])
    try:
        page.wait_for_function("() => window.__msglabRun !== null", timeout=RUN_TIMEOUT_MS)
        failed = page.evaluate("() => window.__msglabRun.error || null")
        if failed:
            run.unfinished = f"{command} failed to start: {failed}"
            return False
        page.wait_for_function(SETTLED_JS, arg=upto, timeout=RUN_TIMEOUT_MS)
    except PlaywrightTimeout:
        run.unfinished = f"{command} had not settled after {RUN_TIMEOUT_MS // 1000} s"
        return False
    return True


def _record_prediction(page: Any, run: LessonRun, cell: int) -> str:
    """Answer the prediction widget of cell `cell` as a learner would (a number typed, or the first choice picked),
    press its button, and return what was recorded ("" if the widget did not take it)."""
    from playwright.sync_api import Error as PlaywrightError

    page.evaluate(MARK_JS, [cell, "predict"])
    box = page.locator('[data-msglab="predict"]')
    try:
        if box.locator('input[type="radio"]').count():
            said = box.locator("label").first.inner_text().strip()
            box.locator('input[type="radio"]').first.check()
        else:
            said = "7"
            box.locator('input[type="text"]').fill(said)
        box.get_by_role("button", name="Record my prediction").click()
        box.get_by_text(f"Recorded: {said}").wait_for(timeout=10_000)
    except PlaywrightError as exc:
        run.clicks.append(f"the prediction widget did not record an answer: {_first_line(str(exc))}")
        return ""
    return said


def _check_reveal(run: LessonRun, reveal: int, said: str) -> None:
    """The reveal after the prediction shows the recorded answer beside the measurement."""
    if not said:
        return
    shown = run.revealed = " ".join((o["shown"] or o["text"] or "") for o in run.state["cells"][reveal]["outputs"])
    if f"You said {said};" not in shown or "measured" not in shown:
        run.clicks.append(f"the reveal does not compare the recorded answer {said!r} with the measurement: {shown!r}")


def _answer_quiz(page: Any, run: LessonRun, clicks: Clicks) -> None:
    """Pick a wrong answer to the first question, then the right one: each shows its own feedback."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect

    page.evaluate(MARK_JS, [clicks.quiz, "quiz"])
    first = page.locator('[data-msglab="quiz"] .widget-radio-box').first
    for answer, mark in ((clicks.wrong, "Not quite."), (clicks.right, "Right.")):
        try:
            first.get_by_label(answer.text, exact=True).check()
            expect(page.locator('[data-msglab="quiz"]')).to_contain_text(f"{mark} {answer.feedback[:40]}")
        except (PlaywrightError, AssertionError) as exc:
            run.clicks.append(
                f"quiz answer {answer.text!r} did not show {mark!r} and its feedback: {_first_line(str(exc))}"
            )


def _screenshot(page: Any, path: Path) -> None:
    """The whole notebook in one picture: grow the window to the notebook's height (capped), top first."""
    extra = page.evaluate(
        """() => { const o = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
                   if (!o) return 0; o.scrollTop = 0; return o.scrollHeight - o.clientHeight; }"""
    )
    page.set_viewport_size({"width": 1400, "height": min(1000 + int(extra or 0), 16000)})
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_in_browser(course: Course, lesson: Path) -> None:
    """A lesson run as a learner runs it (a prediction recorded, a quiz answered) shows no error, renders every
    widget, compares the recorded prediction with the measurement, and raises nothing in the page."""
    run = run_notebook(
        course, lesson.relative_to(ROOT).as_posix(), SCREENSHOTS / f"{lesson.stem}.png", Clicks.of(lesson)
    )
    assert run.state["path"] == lesson.relative_to(ROOT).as_posix()
    problems = run.problems()
    # Beside the screenshot, what was checked: for a person looking at the run afterwards.
    cells = run.state["cells"]
    summary = {
        "lesson": lesson.name,
        "code_cells": len(cells),
        "cells_run": sum(c["count"] is not None for c in cells),
        "widget_views": run.widget_outputs(),
        "widgets_drawn": run.rendered_widgets(),
        "page_errors": run.page_errors,
        "revealed": run.revealed,
        "problems": problems,
    }
    (SCREENSHOTS / f"{lesson.stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    assert not problems, f"{lesson.name} in a browser:\n  " + "\n  ".join(problems)
    assert run.rendered_widgets() == run.widget_outputs()


# The checker itself, on two throwaway notebooks: one that must pass (and proves the kernel shares the
# course's server through NATS_URL and that widgets render), one that must be flagged.
GOOD_CELLS = [
    "import os\nimport ipywidgets as widgets\nimport msglab\nprint(os.environ['NATS_URL'])",
    "nc, js = await msglab.connect()\ninfo = await js.account_info()\nawait nc.close()\nprint('jetstream ok')",
    "widgets.VBox([widgets.IntSlider(value=3, description='n'), widgets.Button(description='go')])",
    "",
    "print(msglab.server_info().describe())",
    "raise KeyError('shown on purpose')",  # tagged raises-exception below: not a problem, and Run All goes on
    "print('after the expected error')",
]
BAD_CELLS = [
    "print('before')",
    # A widget view whose model does not exist: the page shows "Error displaying widget".
    "display({'application/vnd.jupyter.widget-view+json': {'model_id': 'nope', 'version_major': 2, 'version_minor': 0},"
    " 'text/plain': 'a widget'}, raw=True)",
    "raise ValueError('deliberate')",
    "print('never runs')",
]


def _notebook(cells: list[str]) -> str:
    def tags(src: str) -> dict[str, list[str]]:
        return {"tags": ["raises-exception"]} if "on purpose" in src else {}

    return json.dumps({
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": tags(src), "source": src, "outputs": [],
                   "execution_count": None} for i, src in enumerate(cells)],
    })  # fmt: skip


@pytest.fixture(scope="module")
def selftest_dir() -> Iterator[Path]:
    """A throwaway folder inside the course root (JupyterLab serves only what is under it)."""
    folder = SELFTEST / secrets.token_hex(4)
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # another run may be using it at the same time
        SELFTEST.rmdir()


# The checker's own tests (a notebook known good, one known bad): every other quick run, every deep run.
CHECK_THE_CHECKER = pytest.mark.skipif(
    not in_this_round("the browser checker", 2), reason="a quick run checks the browser checker every other commit"
)


@CHECK_THE_CHECKER
def test_checker_passes_a_good_notebook(course: Course, selftest_dir: Path) -> None:
    """A notebook with a widget, a JetStream call and an expected error passes; its kernel used the course's server."""
    (selftest_dir / "good.ipynb").write_text(_notebook(GOOD_CELLS))
    run = run_notebook(
        course, (selftest_dir / "good.ipynb").relative_to(ROOT).as_posix(), SCREENSHOTS / "selftest-good.png"
    )
    assert run.problems() == []
    assert run.widget_outputs() == 1 and run.rendered_widgets() == 1
    printed = "".join(o.get("text", "") for o in run.state["cells"][0]["outputs"])
    assert printed.strip() == course.server.url, "the kernel did not get the course's NATS_URL"
    described = "".join(o.get("text", "") for o in run.state["cells"][4]["outputs"])
    assert course.server.version and course.server.version in described
    assert run.state["cells"][5]["outputs"][0]["ename"] == "KeyError"
    assert "after the expected error" in run.state["cells"][6]["outputs"][0]["text"]


@CHECK_THE_CHECKER
def test_checker_flags_an_error(course: Course, selftest_dir: Path) -> None:
    """A cell that raises is reported, so are the cells Run All then skipped, and so is a broken widget."""
    (selftest_dir / "bad.ipynb").write_text(_notebook(BAD_CELLS))
    run = run_notebook(
        course, (selftest_dir / "bad.ipynb").relative_to(ROOT).as_posix(), SCREENSHOTS / "selftest-bad.png"
    )
    problems = run.problems()
    assert any("ValueError: deliberate" in p for p in problems), problems
    assert any("never ran" in p for p in problems), problems
    assert any("a widget did not render" in p and "Error displaying widget" in p for p in problems), problems
    assert run.state["cells"][2]["outputs"][0]["traceback"], "the traceback is not shown on the page"
