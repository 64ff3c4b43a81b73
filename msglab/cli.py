"""The `msglab` command: check a lab, run a server, diagnose the set-up, open the course.

Exit codes: 0 pass (or success), 1 a lab check failed, 2 usage or environment error.
"""

from __future__ import annotations

import argparse
import sys

from msglab.errors import MsglabError


def _check(args: argparse.Namespace) -> int:
    from msglab.grading.grade import grade

    verdict = grade(args.lab, solution=args.solution, seed=args.seed)
    print(verdict.to_json() if args.json else verdict.to_text())
    return 0 if verdict.passed else 1


def _list(args: argparse.Namespace) -> int:
    from msglab.catalog import all_labs

    for lab in all_labs():
        print(f"{lab.number}  {lab.name:<36} {lab.title}   (edit {lab.folder.name}/{lab.file})")
    return 0


def _server(args: argparse.Namespace) -> int:
    from msglab.broker.server import EmbeddedServer

    server = EmbeddedServer(monitor=True).start()
    print(f"nats-server {server.version} with JetStream ({server.binary.source}: {server.binary.path})")
    print(f"  client URL:  {server.url}      export NATS_URL={server.url}")
    print(f"  monitoring:  http://{server.host}:{server.monitor_port}")
    print("  Ctrl-C stops it (its data is temporary).", flush=True)
    try:
        assert server.proc is not None
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from msglab.doctor import run_doctor

    return run_doctor()


def _lab(args: argparse.Namespace) -> int:
    from msglab.jupyter import run_lab

    return run_lab(port=args.port, open_browser=not args.no_browser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msglab", description="A hands-on course on reliable messaging with NATS JetStream."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="grade a lab against a real server under injected faults")
    check.add_argument("lab", help="lab number or name, e.g. 01 or 01_request_reply_vs_events")
    check.add_argument("--solution", action="store_true", help="grade the reference solution instead of your file")
    check.add_argument("--seed", type=int, help="replay the faults of an earlier run")
    check.add_argument("--json", action="store_true", help="print the verdict as JSON")
    check.set_defaults(func=_check)
    sub.add_parser("list", help="list the labs").set_defaults(func=_list)
    sub.add_parser("server", help="run a JetStream server in the foreground").set_defaults(func=_server)
    sub.add_parser("doctor", help="say what works and what to do about what does not").set_defaults(func=_doctor)
    lab = sub.add_parser("lab", help="open the course in JupyterLab, with a shared server")
    lab.add_argument("--port", type=int, default=None, help="JupyterLab port (default: 8888, or a free one)")
    lab.add_argument("--no-browser", action="store_true", help="do not try to open a browser")
    lab.set_defaults(func=_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0 pass, 1 fail, 2 usage or environment error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except MsglabError as exc:
        print(f"msglab: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
