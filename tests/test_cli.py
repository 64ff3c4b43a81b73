"""The `msglab` command as a learner meets it: verdicts, exit codes, clear errors."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from msglab.broker.server import EmbeddedServer
from msglab.grading.verdict import Check, Verdict

LAB01 = "01_request_reply_vs_events"


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Attempts these tests record go to a temporary folder, never the checkout's .msglab/."""
    folder = tmp_path / "state"
    monkeypatch.setenv("MSGLAB_STATE_DIR", str(folder))
    return folder


@pytest.fixture
def course(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A course of lab 01 alone (its folder and solution as they are now), for tests that edit it."""
    root = tmp_path / "course"
    for folder in ("labs", "solutions"):
        shutil.copytree(ROOT / folder / LAB01, root / folder / LAB01, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("MSGLAB_ROOT", str(root))
    return root


def cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NATS_URL"}


def test_check_solution_passes_with_exit_0_and_names_the_server(state_dir: Path) -> None:
    done = run_cli("check", "01", "--solution", "--seed", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "nats-server" in done.stdout
    assert not state_dir.exists(), "grading the reference solution is no attempt of the learner's"


def test_a_lessons_demonstration_check_is_no_attempt(state_dir: Path) -> None:
    done = run_cli("check", "01", "--seed", "7", "--no-attempt")  # what lesson 00 runs on the starter
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "now shows" not in done.stdout
    assert not state_dir.exists(), "a demonstration opens no hint level and counts towards no solution"


def test_json_verdict_is_machine_readable_for_autograders() -> None:
    done = run_cli("check", "01_request_reply_vs_events", "--solution", "--json", "--seed", "2")
    verdict = json.loads(done.stdout)
    assert verdict["passed"] is True and verdict["seed"] == 2
    assert {c["name"] for c in verdict["checks"]} >= {"no_lost_emails", "faults_fired"}
    assert all(c["hint"] == "" for c in verdict["checks"]), "a passed check carries no hint"


def test_unknown_lab_is_a_usage_error_that_lists_the_labs() -> None:
    done = run_cli("check", "99")
    assert done.returncode == 2
    assert "there is no lab called '99'" in done.stderr and "01 (01_request_reply_vs_events)" in done.stderr
    assert "Traceback" not in done.stderr


def test_unreachable_nats_url_is_an_environment_error_not_a_traceback() -> None:
    done = run_cli("check", "01", env={"NATS_URL": "nats://127.0.0.1:1"})
    assert done.returncode == 2
    assert "no NATS server answers at nats://127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr


def test_check_on_a_shared_server_isolates_its_names_and_cleans_up() -> None:
    import asyncio

    from msglab.broker import connect_js

    with EmbeddedServer() as shared:
        done = run_cli("check", "01", "--solution", "--seed", "3", env={"NATS_URL": shared.url})
        assert done.returncode == 0, done.stdout + done.stderr
        assert "names prefixed" in done.stdout

        async def leftovers() -> list[str]:
            nc, js = await connect_js(shared.url)
            names = [s.config.name for s in await js.streams_info()]
            await nc.close()
            return names

        assert asyncio.run(leftovers()) == []


def test_doctor_reports_every_probe_ok_here() -> None:
    done = run_cli("doctor")
    assert done.returncode == 0, done.stdout
    assert "everything works" in done.stdout and "PROBLEM" not in done.stdout


def test_doctor_says_what_to_do_about_a_dead_nats_url() -> None:
    done = run_cli("doctor", env={"NATS_URL": "nats://127.0.0.1:1"})
    assert done.returncode == 2
    assert "PROBLEM NATS_URL" in done.stdout and "what to do:" in done.stdout


def test_doctor_names_a_broken_notebook_and_how_to_restore_it(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(ROOT / "labs", tmp_path / "labs")
    shutil.copytree(ROOT / "lessons", tmp_path / "lessons")
    broken = tmp_path / "labs" / "01_request_reply_vs_events" / "lab.ipynb"
    broken.write_text(broken.read_text()[:200])  # a half-saved file
    done = run_cli("doctor", env={"MSGLAB_ROOT": str(tmp_path)})
    assert done.returncode == 2
    assert "PROBLEM notebooks" in done.stdout and "lab.ipynb is not valid JSON" in done.stdout
    assert "git checkout -- lab.ipynb" in done.stdout
    assert (tmp_path / "labs" / "01_request_reply_vs_events" / "orders.py").is_file()  # nothing else touched


def test_server_command_prints_a_usable_url_and_stops_on_ctrl_c_even_started_with_sigint_ignored(
    reaped: list[subprocess.Popen[str]],
) -> None:
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from msglab.broker import connect_js

    # As a script's `msglab server &` starts it (a shell without job control hands SIGINT on ignored).
    proc = subprocess.Popen([sys.executable, "-m", "msglab", "server"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    reaped.append(proc)
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    url = next(word for word in proc.stdout.readline().split() if word.startswith("nats://"))
    assert banner.startswith("nats-server ") and "JetStream" in banner

    async def use() -> None:
        nc, js = await connect_js(url)
        await js.account_info()
        await nc.close()

    asyncio.run(use())
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(10) == 0


def test_server_command_removes_its_store_on_sigterm(reaped: list[subprocess.Popen[str]]) -> None:
    import asyncio
    from urllib.parse import urlsplit

    from msglab.broker import connect_js

    proc = subprocess.Popen([sys.executable, "-m", "msglab", "server"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    reaped.append(proc)
    assert proc.stdout is not None
    proc.stdout.readline()
    url = next(word for word in proc.stdout.readline().split() if word.startswith("nats://"))
    assert urlsplit(url).username == "admin", "graders find their slots through the admin's URL"

    async def store() -> None:
        nc, js = await connect_js(url)
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.it", b"x")
        await nc.close()

    asyncio.run(store())
    server_pid = next(p for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid))
    cmdline = Path(f"/proc/{server_pid}/cmdline").read_bytes().split(b"\0")
    folder = cmdline[cmdline.index(b"-sd") + 1].decode()
    assert Path(folder).is_dir()
    proc.terminate()
    assert proc.wait(10) == 0
    assert not Path(folder).exists(), "msglab server left its store behind after SIGTERM"


def _child_of(pid: int, parent: int) -> bool:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, IndexError, ValueError):
        return False


def test_playground_can_be_called_again_after_an_edit(no_nats_url: None) -> None:
    import asyncio

    import msglab

    async def twice() -> None:
        for _ in range(2):  # the lab notebooks say: re-run the cell after each edit
            env, lab = await msglab.playground("01")
            assert callable(lab.place_order)
            await msglab.playground_close(env)

    asyncio.run(twice())
    assert callable(msglab.playground)


def test_a_failing_check_exits_1_says_how_to_replay_and_failing_it_twice_opens_level_2(course: Path) -> None:
    first = run_cli("check", "01", "--seed", "7", "--json")
    assert first.returncode == 1, first.stdout + first.stderr
    target = next(c for c in json.loads(first.stdout)["checks"] if not c["passed"])
    assert not any("now shows" in note for note in json.loads(first.stdout)["notes"])  # level 1: the verdict
    toml = course / "labs" / LAB01 / "lab.toml"
    toml.write_text(
        'title = "Lab 01"\nfile = "orders.py"\n'
        f'[hints.{target["name"]}]\nconcept = "THE IDEA"\nlesson = "section 2"\ncode = "THE CODE"\n'
    )
    second = run_cli("check", "1", "--seed", "7")  # a lab's number alone names it too
    assert second.returncode == 1, second.stdout + second.stderr
    assert "replay this exact run: msglab check 01 --seed 7" in second.stdout
    # The CLI itself never shows a traceback (a learner's own, quoted as rule 3's evidence, may show).
    assert "Traceback" not in second.stderr and "msglab/cli.py" not in second.stdout
    assert "`msglab hint 01` now shows level 2" in second.stdout and target["title"] in second.stdout
    assert "solution" not in second.stdout  # two failed attempts are too few for that
    hint = run_cli("hint", "01")
    assert "THE IDEA" in hint.stdout and "section 2" in hint.stdout and "THE CODE" not in hint.stdout
    assert "level 3 opens if this check fails again" in hint.stdout


def test_progress_after_a_pass_shows_when_and_the_seed(course: Path) -> None:
    shutil.copy(course / "solutions" / LAB01 / "orders.py", course / "labs" / LAB01 / "orders.py")
    assert run_cli("check", "01", "--seed", "5").returncode == 0
    done = run_cli("progress")
    row = next(line for line in done.stdout.splitlines() if line.startswith(LAB01))
    assert "passed" in row and f"{datetime.now():%Y-%m-%d}" in row and row.endswith("seed 5"), done.stdout
    assert "passed" in run_cli("list").stdout
    assert "passed; no hints needed" in run_cli("hint", "01").stdout


def test_watch_regrades_on_save_and_stops_cleanly_on_ctrl_c(course: Path, reaped: list[subprocess.Popen[str]]) -> None:
    lab_file = course / "labs" / LAB01 / "orders.py"
    proc = subprocess.Popen(
        [sys.executable, "-m", "msglab", "watch", "01", "--no-clear"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=course, env=cli_env(),
    )  # fmt: skip
    reaped.append(proc)
    out, err = proc.stdout, proc.stderr
    assert out is not None and err is not None
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # a thread reads, so that waiting for a line can have a deadline
        for line in out:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()

    def wait_for(start: str, deadline: float = 60) -> list[str]:
        """The lines up to the first that starts with `start`; queue.Empty if none comes in time."""
        seen: list[str] = []
        until = time.monotonic() + deadline
        while not (seen and seen[-1].startswith(start)):
            seen.append(lines.get(timeout=max(until - time.monotonic(), 0)))
        return seen

    try:
        first = wait_for(f"waiting for changes to labs/{LAB01}/orders.py... (Ctrl-C to stop)")
        assert first[0].startswith(f"lab {LAB01}: FAIL"), first
        lab_file.write_text((course / "solutions" / LAB01 / "orders.py").read_text())
        second = wait_for("waiting for changes")
        assert second[0].startswith(f"lab {LAB01}: PASS"), second
    finally:
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    assert "Traceback" not in err.read()


def test_a_save_that_does_not_change_the_content_is_no_change(tmp_path: Path) -> None:
    from msglab.cli import FileChanges

    path = tmp_path / "orders.py"
    path.write_text("v1")
    changes = FileChanges(path)
    assert changes.changed()  # the first look grades
    os.utime(path, ns=(1, 1))  # saved again, same content: a new mtime only
    assert not changes.changed()
    path.write_text("v2")
    assert changes.changed() and not changes.changed()
    path.unlink()
    assert changes.changed()  # a deleted file is news too


def test_a_closed_pipe_ends_the_output_quietly(course: Path) -> None:
    # A verdict of an empty file is printed like any other, without a run of the grader.
    (course / "labs" / LAB01 / "orders.py").write_text("# nothing yet\n")
    for args in (["list"], ["check", "01", "--seed", "1"]):
        read, write = os.pipe()
        os.close(read)  # like `| head -1` that has already gone
        done = subprocess.run(
            [sys.executable, "-m", "msglab", *args], stdout=write, stderr=subprocess.PIPE, text=True, cwd=course,
            env=cli_env(), timeout=120,
        )  # fmt: skip
        os.close(write)
        assert done.returncode == 141 and done.stderr == "", done.stderr


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        (["check", "99", "--json"], {}, "there is no lab called '99'"),
        (["check", "--json"], {}, "the following arguments are required: lab"),
        (["check", "01", "--json", "--seed", "x"], {}, "invalid int value: 'x'"),
        (["check", "01", "--json"], {"NATS_URL": "nats://127.0.0.1:1"}, "no NATS server answers"),
    ],
)
def test_json_errors_come_as_json_with_exit_2(args: list[str], env: dict[str, str], error: str) -> None:
    done = run_cli(*args, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    answer = json.loads(done.stdout)
    assert error in answer["error"] and answer["hint"], answer


def test_list_prints_paths_the_learner_can_open_and_the_status(tmp_path: Path) -> None:
    for cwd, prefix in ((ROOT, "labs/"), (ROOT / "labs", ""), (tmp_path, f"{ROOT}/labs/")):
        done = subprocess.run(
            [sys.executable, "-m", "msglab", "list"], capture_output=True, text=True, cwd=cwd, env=cli_env()
        )
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():
            where = line.split(" edit ")[1]
            assert where.startswith(prefix) and (cwd / where).is_file(), line
            assert "not tried" in line  # nothing recorded in this test's state folder


def test_a_passed_check_carries_no_hint_in_text_json_or_html() -> None:
    verdict = Verdict(
        lab=LAB01, graded="labs/x.py", seed=1,
        checks=[Check("kept", "an invariant that held", True, hint="A HINT THAT MUST NOT SHOW")],
    )  # fmt: skip
    for shown in (verdict.to_text(), verdict.to_json(), verdict._repr_html_()):
        assert "A HINT THAT MUST NOT SHOW" not in shown


def test_a_grader_error_exits_2_and_says_it_is_the_courses_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state_dir: Path
) -> None:
    lab = tmp_path / "course" / "labs" / "01_no_such_grader"
    lab.mkdir(parents=True)
    (lab / "lab.toml").write_text('title = "A lab whose grader is missing"\nfile = "x.py"\n')
    (lab / "x.py").write_text("x = 1\n")  # real code: an empty file is the learner's FAIL
    monkeypatch.setenv("MSGLAB_ROOT", str(tmp_path / "course"))
    done = run_cli("check", "01")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "failed inside the grader" in done.stderr and "this is the course's fault" in done.stderr
    as_json = json.loads(run_cli("check", "01", "--json").stdout)
    assert "course's fault" in as_json["hint"]
    assert not state_dir.exists(), "a grader error is no attempt"


@pytest.mark.parametrize(
    "typed",
    [
        ["check", "01", "--seed", "42"],
        ["check", "--seed=42", "01", "--json"],
        ["check", "01", "--se", "42", "--solution"],
    ],
)
def test_a_seed_typed_on_the_command_line_is_handed_on_in_the_environment(
    monkeypatch: pytest.MonkeyPatch, typed: list[str]
) -> None:
    # Every user reads a process's command line (/proc/<pid>/cmdline), learner code included: `msglab check`
    # starts over without the seed (tests/test_hostile_grader.py shows no learner process sees it).
    from msglab import cli

    started: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: started.append((list(argv), dict(env))))
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "msglab", *typed])  # as typed: the same interpreter part
    cli._seed_off_argv(typed, cli.build_parser().parse_args(typed))
    [(argv, env)] = started
    assert argv[:3] == [sys.executable, "-m", "msglab"] and "42" not in argv and env[cli.SEED_VARIABLE] == "42"
    assert argv[3:] == [word for word in typed if word not in ("--seed", "--seed=42", "--se", "42")]
    cli._seed_off_argv(["check", "01"], cli.build_parser().parse_args(["check", "01"]))
    assert len(started) == 1, "no seed, nothing to hide"
