"""The `msglab` command: check a lab, get hints, see progress, reset or watch a lab, run a server.

Exit codes: 0 pass (or success), 1 a lab check failed, 2 usage or environment error, 141 the
reader of our output went away (`msglab check 01 | head -1`), as for a process killed by SIGPIPE.
With `--json`, errors are JSON on stdout too: {"error": "...", "hint": "..."}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, cast

from msglab.errors import MsglabError

if TYPE_CHECKING:
    from msglab.grading.verdict import Verdict

WATCH_POLL = 0.3  # seconds between looks at the watched file: a stat, cheap enough to feel instant


SEED_VARIABLE = "MSGLAB_CHECK_SEED"  # `--seed`, handed over off the command line (`_seed_off_argv`)


def _check(args: argparse.Namespace) -> int:
    from msglab.grading.grade import grade

    seed = args.seed
    handed = os.environ.pop(SEED_VARIABLE, "")
    if seed is None and handed:
        try:
            seed = int(handed)
        except ValueError:
            raise MsglabError(
                f"{SEED_VARIABLE}={handed!r} is no seed", hint="a seed is a whole number, e.g. 4242"
            ) from None
    verdict = grade(args.lab, solution=args.solution, seed=seed)
    if not args.solution and args.attempt:
        _record(verdict)
    print(verdict.to_json() if args.json else verdict.to_text())
    return 0 if verdict.passed else 1


def _record(verdict: Verdict) -> None:
    """Count the verdict as an attempt and add its notes; a state folder we cannot write costs no verdict."""
    from msglab.attempts import record

    try:
        verdict.notes += record(verdict)
    except MsglabError as exc:
        print(f"msglab: this attempt was not recorded: {exc}", file=sys.stderr)


def _hint(args: argparse.Namespace) -> int:
    from msglab.attempts import hint_text
    from msglab.catalog import find_lab

    print(hint_text(find_lab(args.lab)))
    return 0


def _progress(args: argparse.Namespace) -> int:
    from msglab.attempts import progress

    print(progress().to_text())
    return 0


def _reset(args: argparse.Namespace) -> int:
    from msglab.attempts import reset_lab
    from msglab.catalog import display_path, find_lab

    lab = find_lab(args.lab)
    outcome = reset_lab(lab)
    shown = display_path(outcome.path)
    if not outcome.restored:
        print(f"{shown} is already the starter as committed: nothing to reset.")
        return 0
    if outcome.backup:
        print(f"your version of {shown} is saved as {display_path(outcome.backup)}")
    print(f"{shown} is the starter again (as committed in git); `msglab check {lab.number}` grades it")
    return 0


def _watch(args: argparse.Namespace) -> int:
    """Re-grade on every save that changes the file's content, until Ctrl-C (exit 0)."""
    from msglab.catalog import display_path, find_lab

    lab = find_lab(args.lab)
    path = lab.source()
    changes = FileChanges(path)
    clear = not args.no_clear and sys.stdout.isatty()
    try:
        while True:
            if changes.changed():
                if clear:
                    print("\033[2J\033[H", end="")
                _watch_once(lab.number, path)
                print(f"waiting for changes to {display_path(path)}... (Ctrl-C to stop)", flush=True)
            time.sleep(WATCH_POLL)
    except KeyboardInterrupt:
        print(flush=True)
        return 0


class FileChanges:
    """Whether a file's content changed since last asked: a cheap stat every time, a hash only when it moved.

    The hash is why an editor's save of unchanged content (a new mtime) does not re-grade.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stamp: tuple[int, int] | None = None  # (mtime, size) when last looked at
        self.digest: str | None = None  # content hash when last reported as changed

    def changed(self) -> bool:
        try:
            info = self.path.stat()
            stamp: tuple[int, int] | None = (info.st_mtime_ns, info.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self.stamp and self.digest is not None:
            return False
        self.stamp = stamp
        try:
            digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        except FileNotFoundError:
            digest = "missing"
        if digest == self.digest:
            return False
        self.digest = digest
        return True


def _watch_once(number: str, path: Path) -> None:
    from msglab.grading.grade import grade

    if not path.is_file():
        print(f"{path} does not exist; `msglab reset {number}` restores the starter")
        return
    try:
        verdict = grade(number)
    except MsglabError as exc:  # no server, a grader bug: say so and keep watching
        print(f"msglab: {exc}")
        return
    _record(verdict)
    print(verdict.to_text())


def _list(args: argparse.Namespace) -> int:
    from msglab.attempts import progress
    from msglab.catalog import display_path

    report = progress()
    if report.notice:
        print(f"msglab: {report.notice}", file=sys.stderr)
    rows = report.rows
    title = max((len(row.lab.title) for row in rows), default=0)
    status = max((len(row.status) for row in rows), default=0)
    for row in rows:
        where = display_path(row.lab.source())
        print(f"{row.lab.number}  {row.lab.title:<{title}}  {row.status:<{status}}  edit {where}")
    return 0


def _server(args: argparse.Namespace) -> int:
    import signal

    from msglab.broker.server import EmbeddedServer
    from msglab.broker.users import start_shared_server

    # A shared server: graders on it get a slot each whose user may touch only the slot's names.
    started, url = start_shared_server(monitor=True)
    server = cast(EmbeddedServer, started)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM too: the finally below removes the store

    previous = signal.signal(signal.SIGTERM, stop)
    print(f"nats-server {server.version} with JetStream ({server.binary.source}: {server.binary.path})")
    print(f"  client URL:  {url}      export NATS_URL={url}")
    print(f"  monitoring:  http://{server.host}:{server.monitor_port}")
    print("  Ctrl-C stops it (its data is temporary).", flush=True)
    try:
        assert server.proc is not None
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from msglab.doctor import run_doctor

    return run_doctor()


def _lab(args: argparse.Namespace) -> int:
    from msglab.jupyter import run_lab

    return run_lab(port=args.port, open_browser=not args.no_browser)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a MsglabError, so that `--json` can answer it in JSON."""

    def error(self, message: str) -> NoReturn:
        raise MsglabError(message, hint=self.format_usage().strip())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="msglab", description="A hands-on course on reliable messaging with NATS JetStream.")
    sub = parser.add_subparsers(dest="command", required=True)
    lab_help = "lab number or name, e.g. 01 or 01_request_reply_vs_events"
    check = sub.add_parser("check", help="grade a lab against a real server under injected faults")
    check.add_argument("lab", help=lab_help)
    check.add_argument("--solution", action="store_true", help="grade the reference solution instead of your file")
    check.add_argument("--seed", type=int, help="replay the faults of an earlier run")
    check.add_argument("--json", action="store_true", help="print the verdict (or the error) as JSON")
    check.add_argument(
        "--no-attempt", dest="attempt", action="store_false", help="a demonstration: do not count it as an attempt"
    )
    check.set_defaults(func=_check)
    hint = sub.add_parser("hint", help="the hints open for the checks that failed in your last check")
    hint.add_argument("lab", help=lab_help)
    hint.set_defaults(func=_hint)
    progress = sub.add_parser("progress", help="every lab: passed or not, when, with which seed, attempts")
    progress.set_defaults(func=_progress)
    reset = sub.add_parser("reset", help="restore a lab's starter file from git (your version is backed up)")
    reset.add_argument("lab", help=lab_help)
    reset.set_defaults(func=_reset)
    watch = sub.add_parser("watch", help="re-grade a lab every time you save its file")
    watch.add_argument("lab", help=lab_help)
    watch.add_argument("--no-clear", action="store_true", help="do not clear the screen before each verdict")
    watch.set_defaults(func=_watch)
    sub.add_parser("list", help="list the labs, the files to edit and your status").set_defaults(func=_list)
    sub.add_parser("server", help="run a JetStream server in the foreground").set_defaults(func=_server)
    sub.add_parser("doctor", help="say what works and what to do about what does not").set_defaults(func=_doctor)
    lab = sub.add_parser("lab", help="open the course in JupyterLab, with a shared server")
    lab.add_argument("--port", type=int, default=None, help="JupyterLab port (default: 8888, or a free one)")
    lab.add_argument("--no-browser", action="store_true", help="do not try to open a browser")
    lab.set_defaults(func=_lab)
    from msglab.classroom.commands import register

    register(sub)  # release, grade, classroom serve|status|autograder, join
    return parser


def _seed_off_argv(argv: list[str], args: argparse.Namespace) -> None:
    """`msglab check NN --seed S` starts over without the seed on its command line, which every user of
    the machine can read (/proc/<pid>/cmdline), learner code included: the seed comes in the environment,
    which only the grader's own user reads. This happens before any learner process exists."""
    if args.command != "check" or args.seed is None:
        return
    rest: list[str] = []
    skip = False
    for word in argv:
        option = word.split("=", 1)[0]
        if skip:
            skip = False
        elif len(option) > 3 and "--seed".startswith(option):  # --seed S, --seed=S, or argparse's --se S
            skip = "=" not in word
        else:
            rest.append(word)
    # The interpreter's part of the command line as it was typed (`python -m msglab`, the `msglab` script),
    # so the new process finds its modules exactly where this one did (never the working directory instead).
    whole = sys.orig_argv
    start = whole[: len(whole) - len(argv)]
    again = build_parser().parse_args(rest)
    if whole[len(start) :] != argv or not start or {**vars(again), "seed": args.seed} != vars(args):
        return  # not a command line we can rebuild; grade it as typed
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *start[1:], *rest], {**os.environ, SEED_VARIABLE: str(args.seed)})


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 pass, 1 fail, 2 usage or environment error)."""
    typed = argv is None  # this process's own command line: a seed on it is moved off (`_seed_off_argv`)
    argv = sys.argv[1:] if argv is None else argv
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        # Started by a shell without job control (`cmd &` in a script), SIGINT comes ignored: `server`,
        # `watch`, `lab` and `classroom serve` would never stop on Ctrl-C or `kill -INT`.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            args = build_parser().parse_args(argv)
            if typed:
                _seed_off_argv(argv, args)
            code = int(args.func(args))
        except SystemExit as exc:  # --help
            return int(exc.code or 0)
        except MsglabError as exc:
            _error(exc, as_json="--json" in argv)
            return 2
        except KeyboardInterrupt:
            return 130
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader left (`| head -1`): stop quietly, and keep Python from failing again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _error(exc: MsglabError, as_json: bool) -> None:
    if as_json:
        message = exc.args[0] if exc.args else str(exc)
        print(json.dumps({"error": message, "hint": exc.hint}))
    else:
        print(f"msglab: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
