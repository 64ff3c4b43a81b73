"""`make bench`: how long the course makes a learner wait, measured on this machine. A benchmark, not a test.

Measures, each as the median of several runs:
  * the floor: a bare `python -c pass` start plus a bare nats-server start (ready line);
  * the embedded server until a client can use JetStream (start, connect, js.account_info());
  * every lab's `msglab check NN` verdict, on the solution and on the starter, run as a learner runs it
    (`python -m msglab check`, a fresh subprocess with its own server and random faults), and its ratio to the floor;
  * every lesson executed headless (nbclient) with the environment `make lab` gives kernels;
  * `import msglab` and the check path's imports, and whether Jupyter, ipywidgets, matplotlib or
    rfc3987_syntax are imported on the check path (they must not be);
  * a generated class of 30 learners (solutions, starters, wrong and right variants, a broken file,
    missing files) graded by `msglab grade` over every lab: the class time (goal 3 minutes) and the
    CPU per verdict (goal 0.5 s), measured in the workers and for the whole run.
Prints a table (rows over the goal are flagged) and writes var/bench.json.
Exit code: 1 if a heavy module is imported on the check path, else 0 (timings are reported, never fatal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without relying on the editable install

from msglab.broker.server import EmbeddedServer  # noqa: E402
from msglab.catalog import all_labs  # noqa: E402
from msglab.jupyter import lab_env  # noqa: E402

VERDICT_GOAL = 1.5  # seconds, median `msglab check` for every lab
CLASS_GOAL = 180.0  # seconds, `msglab grade` of 30 learners x every lab
CPU_GOAL = 0.5  # CPU seconds per verdict (grader, server, fork server, learner processes)
LESSON_GOAL = 30.0  # seconds, each lesson executed headless
HEAVY = ("jupyter", "ipywidgets", "matplotlib", "rfc3987_syntax", "IPython", "ipykernel")  # import-name prefixes


def _env() -> dict[str, str]:
    # As a learner's terminal: no shared server, so each check starts its own (as `msglab check` does).
    drop = ("NATS_URL", "MSGLAB_SERVER_VERSION", "MSGLAB_SERVER_BINARY")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _wall(args: list[str], **kwargs: Any) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=_env(), **kwargs)
    return time.perf_counter() - started, done


def _children_cpu() -> float:
    # CPU seconds of every reaped descendant (the check, its server, its learner processes): on a shared
    # machine wall time moves with the load, CPU time much less, so the two together tell waiting from work.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def bench_floor(runs: int) -> dict[str, Any]:
    """A bare interpreter start and a bare server start: the least any verdict can cost."""
    python = [_wall([sys.executable, "-c", "pass"])[0] for _ in range(runs)]
    server, jetstream = [], []
    version = None
    for _ in range(runs):
        ready, usable, version = asyncio.run(_server_once())
        server.append(ready)
        jetstream.append(usable)
    floor = statistics.median(python) + statistics.median(server)
    return {
        "python_start": _stats(python),
        "server_ready": _stats(server),
        "server_jetstream_usable": _stats(jetstream),
        "floor": floor,
        "server_version": version,
    }


async def _server_once() -> tuple[float, float, str | None]:
    import nats

    started = time.perf_counter()
    server = EmbeddedServer().start()
    ready = time.perf_counter() - started
    try:
        nc = await nats.connect(server.url)
        await nc.jetstream().account_info()
        usable = time.perf_counter() - started
        await nc.close()
    finally:
        server.stop()
    return ready, usable, server.version


def bench_labs(runs: int, floor: float) -> list[dict[str, Any]]:
    """Every lab's verdict time, solution and starter, as `python -m msglab check NN [--solution] --json`."""
    rows = []
    for lab in all_labs():
        for graded in ("solution", "starter"):
            args = [sys.executable, "-m", "msglab", "check", lab.number, "--json"]
            if graded == "solution":
                args.append("--solution")
            times, passed, codes, seeds, inside, cpu = [], 0, [], [], [], []
            for _ in range(runs):
                cpu_before = _children_cpu()
                seconds, done = _wall(args, timeout=300)
                cpu.append(_children_cpu() - cpu_before)
                times.append(seconds)
                codes.append(done.returncode)
                try:
                    verdict = json.loads(done.stdout)
                    passed += bool(verdict.get("passed"))
                    seeds.append(verdict.get("seed"))
                    if verdict.get("seconds") is not None:
                        inside.append(float(verdict["seconds"]))
                except ValueError:
                    seeds.append(None)
            stats = _stats(times)
            rows.append({
                "lab": lab.name, "number": lab.number, "graded": graded, **stats,
                "grading_inside": statistics.median(inside) if inside else None, "cpu": statistics.median(cpu),
                "ratio_to_floor": stats["median"] / floor, "passed": passed, "exit_codes": codes, "seeds": seeds,
                "over_goal": stats["median"] > VERDICT_GOAL,
            })  # fmt: skip
            _progress(f"lab {lab.number} {graded}: median {stats['median']:.2f} s")
    return rows


def bench_lessons(runs: int) -> list[dict[str, Any]]:
    """Every lesson run top to bottom by nbclient, with one shared server in NATS_URL as `make lab` provides."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    lessons = sorted((ROOT / "lessons").glob("*.ipynb"))
    rows: list[dict[str, Any]] = []
    if not lessons:
        return rows
    kernel_log = ROOT / "var" / "bench-kernels.log"  # kernels' own stderr: kept out of the table, not lost
    kernel_log.parent.mkdir(parents=True, exist_ok=True)
    with (
        EmbeddedServer() as server,
        tempfile.TemporaryDirectory(prefix="msglab-bench-") as tmp,
        open(kernel_log, "w", encoding="utf-8") as kernel_stderr,
    ):
        env = lab_env(server.url, server.version, f"{server.binary.source}: {server.binary.path}", base=_env())
        for lesson in lessons:
            times, error = [], None
            cells = 0
            for _ in range(runs):
                # Executed from a throwaway copy, so nothing can ever write outputs back into the lesson.
                copy = Path(tmp) / lesson.name
                copy.write_bytes(lesson.read_bytes())
                nb = nbformat.read(copy, as_version=4)
                cells = sum(c.cell_type == "code" for c in nb.cells)
                # The lesson's own folder as working directory, as in JupyterLab.
                client = NotebookClient(
                    nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(lesson.parent)}}
                )
                started = time.perf_counter()
                try:
                    client.execute(env=env, stderr=kernel_stderr)  # handed on to the kernel: the server in NATS_URL
                except CellExecutionError as exc:
                    error = _plain(f"{exc.ename}: {exc.evalue}")[:200]
                except Exception as exc:  # a dead kernel or a timeout: report it, go on with the next lesson
                    error = f"{type(exc).__name__}: {exc}"[:200]
                times.append(time.perf_counter() - started)
            stats = _stats(times)
            rows.append({"lesson": lesson.stem, **stats, "code_cells": cells, "error": error,
                         "over_goal": stats["median"] > LESSON_GOAL})  # fmt: skip
            _progress(f"lesson {lesson.stem}: {stats['median']:.1f} s{' (error)' if error else ''}")
    return rows


def bench_class(learners: int, jobs: list[int]) -> dict[str, Any]:
    """`msglab grade` of a generated class, on a copy of the course (with [points] where lab.toml has none yet)."""
    from msglab.classroom import sample
    from msglab.classroom.gradebook import grade_class

    runs = []
    saved = os.environ.get("MSGLAB_ROOT")
    with tempfile.TemporaryDirectory(prefix="msglab-bench-class-") as tmp:
        course = sample.copy_course(Path(tmp) / "course", root=ROOT)
        declared = sample.declare_points(course)
        os.environ["MSGLAB_ROOT"] = str(course)
        try:
            sample.make_class(Path(tmp) / "class", learners)
            for count in jobs:
                _progress(f"class of {learners}, {count} jobs")
                cpu, started = _own_and_children_cpu(), time.perf_counter()
                result = grade_class(Path(tmp) / "class", out=Path(tmp) / f"out-{count}", jobs=count, progress=False)
                seconds, cpu = time.perf_counter() - started, _own_and_children_cpu() - cpu
                graded = result.graded
                labs: dict[str, dict[str, Any]] = {}
                for row in graded:
                    lab = labs.setdefault(row.lab.name, {"verdicts": 0, "seconds": [], "cpu": [], "passed": 0})
                    lab["verdicts"] += 1
                    lab["seconds"].append(row.seconds)
                    lab["cpu"].append(row.cpu)
                    lab["passed"] += bool(row.result and row.result.passed)
                for lab in labs.values():
                    lab.update(seconds=_stats(lab["seconds"]), cpu=statistics.mean(lab["cpu"]))
                runs.append({
                    "jobs": count, "seconds": seconds, "verdicts": len(graded), "rows": len(result.rows),
                    "cpu_total": cpu, "cpu_per_verdict": cpu / max(1, len(graded)),
                    "cpu_per_verdict_in_workers": result.cpu_per_verdict(), "startup_cpu": result.startup_cpu,
                    "grader_errors": len(result.errors), "labs": labs,
                    "class_over_goal": seconds > CLASS_GOAL * learners / 30,
                    "cpu_over_goal": cpu / max(1, len(graded)) > CPU_GOAL,
                })  # fmt: skip
                _progress(f"class of {learners}, {count} jobs: {seconds:.0f} s, {cpu / max(1, len(graded)):.2f} s CPU")
        finally:
            if saved is None:
                os.environ.pop("MSGLAB_ROOT", None)
            else:
                os.environ["MSGLAB_ROOT"] = saved
    return {"learners": learners, "points_declared_for": declared, "runs": runs}


def _own_and_children_cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime + _children_cpu()


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # tracebacks arrive coloured


def _importtime(args: list[str]) -> dict[str, int]:
    """Module -> cumulative import microseconds, from `python -X importtime ...`."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=300)  # fmt: skip
    modules = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
            if cumulative.isdigit():
                modules[name.strip()] = int(cumulative)
    return modules


def bench_imports(runs: int) -> dict[str, Any]:
    """`import msglab`, the check path's imports, and which heavy modules a real check run imports."""
    labs = all_labs()
    check_path = ["msglab.cli", "msglab.grading.grade", *(lab.grader_module for lab in labs)]
    top, path = [], []
    for _ in range(runs):
        top.append(_importtime(["-c", "import msglab"]).get("msglab", 0) / 1e6)
        modules = _importtime(["-c", "import " + ", ".join(check_path)])
        path.append(sum(modules.get(name, 0) for name in check_path) / 1e6)  # top-level entries: no double count
    heavy: dict[str, list[str]] = {}
    for lab in labs:
        modules = _importtime(["-m", "msglab", "check", lab.number, "--solution", "--json"])
        heavy[lab.number] = sorted(m for m in modules if m.split(".")[0].startswith(HEAVY))
    return {"import_msglab": _stats(top), "check_path_modules": check_path, "import_check_path": _stats(path),
            "heavy_on_check_path": heavy}  # fmt: skip


def _progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def render(result: dict[str, Any]) -> str:
    """The human table."""
    out = []
    m = result["machine"]
    out.append(f"msglab bench  {result['when']}  python {m['python']}  {m['cpus']} CPUs  load {m['load']}  "
               f"nats-server {result['floor']['server_version']}")  # fmt: skip
    f = result["floor"]
    out.append(f"\nFloor and server (median of {f['python_start']['runs']})")
    out.append(f"  python -c pass                      {f['python_start']['median']:7.3f} s")
    out.append(f"  nats-server start, ready            {f['server_ready']['median']:7.3f} s")
    out.append(f"  floor (the two added)               {f['floor']:7.3f} s")
    out.append(f"  embedded server until JetStream use {f['server_jetstream_usable']['median']:7.3f} s"
               f"   (start, connect, js.account_info(); min {f['server_jetstream_usable']['min']:.3f},"
               f" max {f['server_jetstream_usable']['max']:.3f})")  # fmt: skip
    if result["labs"]:
        runs = result["labs"][0]["runs"]
        out.append(f"\nLab verdicts: `python -m msglab check NN`, median of {runs} runs, random faults (goal <= "
                   f"{VERDICT_GOAL:.1f} s)")  # fmt: skip
        out.append(f"  {'lab':<28} {'graded':<9} {'median':>7} {'min':>7} {'max':>7} {'grading':>8} {'cpu':>6}"
                   f" {'x floor':>8}  {'passed':>7}")  # fmt: skip
        for r in result["labs"]:
            inside = f"{r['grading_inside']:.2f}" if r["grading_inside"] is not None else "-"
            flag = "  OVER GOAL" if r["over_goal"] else ""
            out.append(f"  {r['lab']:<28} {r['graded']:<9} {r['median']:7.2f} {r['min']:7.2f} {r['max']:7.2f} "
                       f"{inside:>8} {r['cpu']:6.2f} {r['ratio_to_floor']:7.1f}x  "
                       f"{r['passed']:>3}/{r['runs']:<3}{flag}")  # fmt: skip
        out.append("  (seconds; grading: the verdict's own time inside the process; cpu: CPU time of the check and")
        out.append("   everything it started; x floor: median / floor; the starter is meant to fail)")
    if result["lessons"]:
        out.append(
            f"\nLessons run headless (nbclient, one shared server as with `make lab`; goal <= {LESSON_GOAL:.0f} s)"
        )
        out.append(f"  {'lesson':<40} {'seconds':>8} {'cells':>6}  result")
        for r in result["lessons"]:
            flag = "  OVER GOAL" if r["over_goal"] else ""
            status = f"ERROR {r['error']}" if r["error"] else "ok"
            out.append(f"  {r['lesson']:<40} {r['median']:8.1f} {r['code_cells']:>6}  {status}{flag}")
    elif "lessons" in result["sections"]:
        out.append("\nLessons: none in lessons/ yet")
    if result.get("class"):
        c = result["class"]
        out.append(f"\nA class graded: `msglab grade`, {c['learners']} learners x every lab (solutions, starters, "
                   f"wrong and right variants, broken and missing files; goals: <= {CLASS_GOAL:.0f} s for 30, "
                   f"<= {CPU_GOAL:.1f} s CPU per verdict)")  # fmt: skip
        if c["points_declared_for"]:
            out.append(f"  ([points] added for the run to {', '.join(c['points_declared_for'])}: their lab.toml "
                       "declares no checks yet)")  # fmt: skip
        for run in c["runs"]:
            time_flag = " (OVER GOAL)" if run["class_over_goal"] else ""
            cpu_flag = " (OVER GOAL)" if run["cpu_over_goal"] else ""
            out.append(f"  {run['jobs']} jobs: {run['verdicts']} verdicts in {run['seconds']:.0f} s{time_flag}; "
                       f"CPU per verdict {run['cpu_per_verdict']:.2f} s{cpu_flag} (whole run, workers' start-up "
                       f"included; {run['cpu_per_verdict_in_workers']:.2f} s inside the workers), "
                       f"{run['grader_errors']} grader errors")  # fmt: skip
            for name, lab in run["labs"].items():
                times = lab["seconds"]
                out.append(f"      {name:<28} {lab['verdicts']:>3} verdicts  median {times['median']:5.2f} s  "
                           f"max {times['max']:5.1f} s  CPU {lab['cpu']:.2f} s  passed {lab['passed']}")  # fmt: skip
    if result["imports"]:
        i = result["imports"]
        out.append(f"\nImports (median of {i['import_msglab']['runs']}, from python -X importtime)")
        out.append(f"  import msglab                       {i['import_msglab']['median'] * 1000:7.1f} ms")
        out.append(
            f"  check path ({len(i['check_path_modules'])} modules)             "
            f"{i['import_check_path']['median'] * 1000:7.1f} ms   ({', '.join(i['check_path_modules'])})"
        )
        for number, heavy in i["heavy_on_check_path"].items():
            more = " ..." if heavy[8:] else ""
            verdict = "IMPORTED: " + ", ".join(heavy[:8]) + more if heavy else "none (good)"
            out.append(f"  heavy modules in `msglab check {number}`: {verdict}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON; exit 1 only if the check path imports a heavy module."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per median (server, checks, imports)")
    parser.add_argument("--lesson-runs", type=int, default=1, help="runs per lesson")
    parser.add_argument("--only", default="labs,lessons,imports,class",
                        help="comma list of: labs, lessons, imports, class")  # fmt: skip
    parser.add_argument("--class-learners", type=int, default=30, help="learners in the generated class")
    parser.add_argument("--class-jobs", default="", help="comma list of job counts (default: msglab grade's)")
    parser.add_argument("--json", default=str(ROOT / "var" / "bench.json"), help="where to write the results")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "load": " ".join(f"{x:.2f}" for x in os.getloadavg())},
        "goals": {"verdict_median_s": VERDICT_GOAL, "lesson_s": LESSON_GOAL, "class_s": CLASS_GOAL,
                  "cpu_per_verdict_s": CPU_GOAL},
        "sections": sorted(sections), "labs": [], "lessons": [], "imports": None, "class": None,
    }  # fmt: skip
    _progress("floor and server")
    result["floor"] = bench_floor(args.runs)
    if "labs" in sections:
        result["labs"] = bench_labs(args.runs, result["floor"]["floor"])
    if "lessons" in sections:
        result["lessons"] = bench_lessons(args.lesson_runs)
    if "imports" in sections:
        _progress("imports")
        result["imports"] = bench_imports(args.runs)
    if "class" in sections:
        from msglab.classroom.gradebook import default_jobs

        jobs = [int(j) for j in args.class_jobs.split(",") if j.strip()] or [default_jobs()]
        result["class"] = bench_class(args.class_learners, jobs)
    result["machine"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    print(f"\n(written to {path}; the machine is shared, so compare runs made under a similar load)")
    heavy = result["imports"]["heavy_on_check_path"] if result["imports"] else {}
    return 1 if any(heavy.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
