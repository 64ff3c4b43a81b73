"""The `msglab` command as a learner meets it: verdicts, exit codes, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, run_cli

from msglab.broker.server import EmbeddedServer


def test_check_solution_passes_with_exit_0_and_names_the_server() -> None:
    done = run_cli("check", "01", "--solution", "--seed", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "nats-server" in done.stdout


def test_check_starter_fails_with_exit_1_and_prints_how_to_replay() -> None:
    done = run_cli("check", "1", "--seed", "9")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "replay this exact run: msglab check 01 --seed 9" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_json_verdict_is_machine_readable_for_autograders() -> None:
    done = run_cli("check", "01_request_reply_vs_events", "--solution", "--json", "--seed", "2")
    verdict = json.loads(done.stdout)
    assert verdict["passed"] is True and verdict["seed"] == 2
    assert {c["name"] for c in verdict["checks"]} >= {"no_lost_emails", "request_reply_no_responders"}


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


def test_server_command_prints_a_usable_url_and_stops_on_ctrl_c() -> None:
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from msglab.broker import connect_js

    proc = subprocess.Popen([sys.executable, "-m", "msglab", "server"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
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
