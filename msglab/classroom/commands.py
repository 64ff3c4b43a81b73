"""The classroom commands of `msglab`: release, grade, classroom serve|status|autograder, join.

`register(subparsers)` adds them to the CLI's argparse subparsers (msglab.cli calls it). Each
command returns its exit code; errors are MsglabError (the CLI prints them, exit code 2).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any


def _release(args: argparse.Namespace) -> int:
    from msglab.classroom.edition import build_edition

    edition = build_edition(Path(args.out), replace=args.replace, git=not args.no_git, allow_dirty=args.allow_dirty,
                            code_hints=args.code_hints, check_starters=not args.no_starter_check)  # fmt: skip
    labs = sorted({name.split("/")[1] for name in edition.files if name.startswith("labs/") and name.count("/") >= 2})
    print(f"learner edition written to {edition.out}: {len(edition.files)} files, labs {', '.join(labs)}")
    print(f"  built from commit {edition.source[:12] or '(not a git repository: the folder as it is)'}")
    for change in edition.not_shipped:
        print(f"  not shipped (--allow-dirty): {change}")
    print("  left out: solutions/, tests/, scripts/, .ci/, docs/instructors.md (and everything git ignores)")
    print("  hints: " + ("every level, code included (--code-hints)" if edition.code_hints else
                         "their code level left out (a graded edition; --code-hints keeps it)"))  # fmt: skip
    if edition.commit:
        print(f"  a git repository of one commit ({edition.commit[:12]}): `msglab reset NN` works in it")
    print(
        "  its own README.md, Makefile (`make lab`, `make test`: lessons headless, starters failing), and "
        ".github/workflows/classroom.yml (GitHub Classroom: points on each push)"
    )
    print("  hand it out as a folder, a zip, or a repository; learners run `make lab` in it")
    return 0


def _grade(args: argparse.Namespace) -> int:
    from msglab.classroom.gradebook import grade_class, select_labs, summary_text

    result = grade_class(
        Path(args.submissions),
        labs=select_labs(args.labs),
        out=Path(args.out),
        jobs=args.jobs,
        salt=args.salt,
        learners=[name.strip() for name in args.learners.split(",")] if args.learners else None,
        progress=not args.no_progress,
        assignment=args.assignment or "",
        starter_behaviour=args.starter_by_behaviour,
    )
    print(summary_text(result))
    if result.errors:
        print(f"msglab: {len(result.errors)} verdict(s) failed inside the grader (the course's fault, not the "
              "learners'): grade them again with --learners", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _serve(args: argparse.Namespace) -> int:
    from msglab.classroom.server import Classroom, Limits, advertised, learner_names, start

    limits = Limits(max_mem=args.max_mem << 20, max_file=args.max_file << 20, max_streams=args.max_streams,
                    max_consumers=args.max_consumers, max_connections=args.max_connections)  # fmt: skip
    names = learner_names(args.learners)
    advertise = advertised(args.advertise or "", local=args.local)  # before anything is written or started
    host = args.host or ("127.0.0.1" if args.local else "0.0.0.0")
    classroom = Classroom.create(
        Path(args.dir), names, limits=limits, host=host, port=args.port,
        advertise=advertise, monitor_host=args.monitor_host, monitor_port=args.monitor_port, tls=args.tls,
    )  # fmt: skip
    server = start(classroom)
    first = next(iter(classroom.learners))
    print(f"msglab classroom: nats-server {server.version} with JetStream, {len(classroom.learners)} learner accounts")
    print(f"  learners connect to: {classroom.scheme}://{classroom.public_host}:{classroom.bound_port}"
          f"   (listening on {classroom.host}:{classroom.bound_port})")  # fmt: skip
    if classroom.tls:
        print(f"  TLS required: the room's CA is {classroom.ca_file} (its key beside it, yours alone); the server's "
              f"certificate names {', '.join(classroom.tls_names())}")  # fmt: skip
    print(f"  per learner:  {limits.describe()}")
    if classroom.tls:
        print(f"  hand out:     {classroom.folder / 'learners'}/<name>.txt (URL with credentials and the room's "
              f"certificate; {classroom.folder / 'handout.csv'} lists them)")  # fmt: skip
        print(f"  e.g. {first}:  msglab join {first}.txt")
    else:
        print(f"  hand out:     {classroom.folder / 'handout.csv'} (one URL with credentials per learner; "
              f"{classroom.folder / 'learners'}/<name>.txt each)")  # fmt: skip
        print(f"  e.g. {first}:  msglab join {classroom.learner_url(first)}")
    print(f"  monitoring:   {classroom.monitor_url}/jsz?accounts=true   (instructor only: bound to "
          f"{classroom.monitor_host})")  # fmt: skip
    print(f"  status:       msglab classroom status --dir {args.dir}")
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop: the server is stopped, not orphaned
    try:
        # Inside the try: a Ctrl-C that follows this line at once is a stop, not a traceback.
        print(f"  Ctrl-C stops the server (SIGTERM too); streams stay in {classroom.folder / 'store'} for the next "
              "start.", flush=True)  # fmt: skip
        assert server.proc is not None
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _status(args: argparse.Namespace) -> int:
    import os

    from msglab.classroom.server import Classroom
    from msglab.classroom.status import render, status

    folder = Path(args.dir)
    if (folder / "tls" / "ca.pem").is_file() and Classroom.load(folder).tls:
        os.environ.setdefault("NATS_CA", str(folder / "tls" / "ca.pem"))  # the instructor's own room, checked
    report = status(folder, Path(args.gradebook) if args.gradebook else None,
                    Path(args.verdicts) if args.verdicts else None)  # fmt: skip
    print(render(report))
    return 0


def _autograder(args: argparse.Namespace) -> int:
    from msglab.classroom.gradebook import select_labs
    from msglab.classroom.gradescope import build_bundle, fetch_wheels, grader_requirements

    labs = select_labs(args.labs)
    wheels = Path(args.wheelhouse) if args.wheelhouse else None
    if args.fetch_wheels:
        wheels = fetch_wheels(Path(args.out) / "wheels", grader_requirements(), platform=args.platform)
    archive = build_bundle(Path(args.out), labs, wheelhouse=wheels, visibility=args.visibility, salt=args.salt)
    print(f"Gradescope autograder for labs {', '.join(lab.number for lab in labs)}: {archive}")
    config = json.loads((Path(args.out) / "autograder" / "msglab-autograder.json").read_text())
    print(
        f"  seeds salted with {config['salt']!r}, faults drawn under the bundle's own plan key: keep this bundle"
        " (its msglab-autograder.json) to regrade a submission under the same faults"
    )
    print("  upload it as the assignment's autograder (base image: Ubuntu 24.04); learners submit their lab files")
    return 0


def _join(args: argparse.Namespace) -> int:
    from msglab.classroom.join import join, leave

    if args.leave:
        print(leave())
        return 0
    if not args.details:
        from msglab.errors import MsglabError

        raise MsglabError("msglab join needs the details your instructor handed out", hint="msglab join nats://...")
    print(join(args.details, check=not args.no_check, ca_file=args.ca))
    return 0


def register(subparsers: Any) -> None:
    """Add release, grade, classroom (serve, status, autograder) and join to msglab's subparsers."""
    release = subparsers.add_parser("release", help="write the learner edition: the course without its solutions")
    release.add_argument("--out", required=True, help="the folder to write (new, or an earlier edition with --replace)")
    release.add_argument("--replace", action="store_true", help="replace an earlier learner edition in --out")
    release.add_argument("--no-git", action="store_true", help="do not make the edition a git repository")
    release.add_argument("--allow-dirty", action="store_true",
                         help="release the last commit although the working tree differs from it")  # fmt: skip
    release.add_argument("--code-hints", action="store_true",
                         help="keep the hints' code level (self-study; a graded edition leaves it out)")  # fmt: skip
    release.add_argument("--no-starter-check", action="store_true",
                         help="do not grade each starter once (a starter that passes stops the release)")  # fmt: skip
    release.set_defaults(func=_release)

    grade = subparsers.add_parser("grade", help="grade every learner's every lab: gradebook, feedback, verdicts")
    grade.add_argument("submissions", help="a folder with one folder per learner, Gradescope's export (zip or folder), "
                       "GitHub Classroom's repositories, or another platform's zip")  # fmt: skip
    grade.add_argument("--labs", help="the labs to grade, e.g. 01,02 (default: every lab)")
    grade.add_argument(
        "--out", default="grades", help="where the gradebook, feedback and verdicts go (default: grades)"
    )
    grade.add_argument("--jobs", type=int, default=None, help="verdicts graded at once (default: one per core)")
    grade.add_argument("--salt", default=None, help="mixed into every seed (default: the salt saved in --out, or a "
                       "new random one): learners cannot replay their graded faults")  # fmt: skip
    grade.add_argument("--learners", help="grade only these learners (comma-separated ids)")
    grade.add_argument("--no-progress", action="store_true", help="no progress bar")
    grade.add_argument("--starter-by-behaviour", action="store_true",
                       help="a failing file that fails the starter's checks on its seed scores as the starter "
                       "(grades the starter once more per such file)")  # fmt: skip
    grade.add_argument("--assignment", help="GitHub Classroom: the repositories' name prefix (default: found)")
    grade.set_defaults(func=_grade)

    classroom = subparsers.add_parser("classroom", help="a shared server for a workshop, its status, an autograder")
    room = classroom.add_subparsers(dest="classroom_command", required=True)
    serve = room.add_parser("serve", help="one nats-server for the room, one NATS account per learner")
    serve.add_argument("--learners", required=True, help="a number (learner01..), names (alice,bob) or a roster file")
    serve.add_argument("--dir", default="classroom", help="where passwords, handouts and streams live")
    serve.add_argument("--host", help="address to listen on (default: every interface; with --local, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=4222, help="client port (default 4222; 0: any free port)")
    serve.add_argument("--advertise", help="the address learners' laptops reach this machine at (required; "
                       "serve lists this machine's addresses without it)")  # fmt: skip
    serve.add_argument("--local", action="store_true", help="a room on this machine only (handouts say 127.0.0.1)")
    serve.add_argument("--tls", action="store_true", help="TLS required of every connection: the room makes its "
                       "own CA (needs msglab[classroom]) and hands out its certificate")  # fmt: skip
    serve.add_argument("--max-connections", type=int, default=32, help="connections per learner (default 32)")
    serve.add_argument("--monitor-host", default="127.0.0.1", help="monitoring address (default: this machine only)")
    serve.add_argument("--monitor-port", type=int, default=8222, help="monitoring port (default 8222; 0: any)")
    serve.add_argument("--max-mem", type=int, default=64, help="MiB of memory storage per learner (default 64)")
    serve.add_argument("--max-file", type=int, default=512, help="MiB of file storage per learner (default 512)")
    serve.add_argument("--max-streams", type=int, default=32, help="streams per learner (default 32)")
    serve.add_argument("--max-consumers", type=int, default=64, help="consumers per stream (default 64)")
    serve.set_defaults(func=_serve)
    status = room.add_parser("status", help="learners, their streams, and the labs each has passed")
    status.add_argument("--dir", default="classroom", help="the folder `classroom serve` used")
    status.add_argument("--gradebook", help="a gradebook.csv from `msglab grade`")
    status.add_argument("--verdicts", help="a folder of verdicts (one folder per learner, JSON files)")
    status.set_defaults(func=_status)
    autograder = room.add_parser("autograder", help="a Gradescope autograder zip (setup.sh, run_autograder)")
    autograder.add_argument("--labs", help="the labs it grades, e.g. 01 (default: every lab)")
    autograder.add_argument("--out", default="autograder", help="where to write autograder.zip")
    autograder.add_argument("--wheelhouse", help="a folder of wheels to install from (an offline image build)")
    autograder.add_argument("--fetch-wheels", action="store_true", help="download the grader's wheels into the bundle")
    autograder.add_argument(
        "--platform", default="manylinux_2_28_x86_64", help="the image's platform for --fetch-wheels"
    )
    autograder.add_argument("--visibility", default="visible", help="visible, hidden, after_due_date, after_published")
    autograder.add_argument("--salt", default=None, help="mixed into every seed (default: a new random one)")
    autograder.set_defaults(func=_autograder)

    join = subparsers.add_parser("join", help="use your account on the classroom server (details from your instructor)")
    join.add_argument("details", nargs="?", help="the nats:// URL handed out, or the file holding it")
    join.add_argument("--leave", action="store_true", help="forget the classroom details")
    join.add_argument("--no-check", action="store_true", help="save the details without trying them")
    join.add_argument("--ca", help="the room's CA certificate (ca.pem), when the details do not hold it")
    join.set_defaults(func=_join)
