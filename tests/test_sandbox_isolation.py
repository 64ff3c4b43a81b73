"""What a learner process inherits from the grader: an import path no learner can write (whatever
the grader's working directory), an environment without the grader's secrets (in os.environ and in
the initial block /proc shows), and no course code that holds a lab's answer."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import PRELUDE, mark_folder

from msglab.catalog import Lab, all_labs
from msglab.grading.grade import grade
from msglab.grading.harness import RUN_PREFIX, runs_folder
from msglab.grading.sandbox import LEARNER_ENV, NURSERY_ENV, Sandbox, learner_environment, nursery_environment
from msglab.grading.verdict import Verdict
from msglab.grading.zygote import Nursery

OWN_USER = Sandbox.for_this_machine().uid is not None
LABS = {lab.number: lab for lab in all_labs()}
SECRET = "s3cret-ci-token-4242"

PROBE = """
def _probe(env):
    import ctypes, json, os, sys
    ctypes.CDLL("libc.so.6").prctl(4, 1)  # PR_SET_DUMPABLE: a process that changed uid can read itself again
    seen = {"path": sys.path, "writable": [p for p in sys.path if p and os.access(p, os.W_OK)],
            "environ": dict(os.environ)}
    for name, where in (("self", "/proc/self/environ"), ("parent", f"/proc/{os.getppid()}/environ")):
        try:
            seen[name] = open(where, "rb").read().decode(errors="replace")
        except OSError as exc:
            seen[name] = f"refused {type(exc).__name__}"
    _report("probe " + json.dumps(seen))
_hostile(_probe, once=True)
"""


@pytest.fixture
def mark() -> Iterator[Path]:
    """A folder outside the run where the probe leaves what it saw."""
    folder = mark_folder("msglab-isolation-")
    yield folder
    for name in os.listdir(folder):
        os.unlink(folder / name)
    folder.rmdir()


@pytest.fixture
def fresh_nursery() -> Iterator[None]:
    """The grading process's nursery started anew inside the test (with the test's cwd and environment)."""
    Nursery.shutdown()
    yield
    Nursery.shutdown()


def graded(lab: Lab, code: str, mark: Path, *, solution: bool = False) -> Verdict:
    """The lab's starter (or solution) with `code` appended, graded on seed 1."""
    folder = Path(tempfile.mkdtemp(prefix="msglab-isolation-src-"))
    path = folder / lab.file
    path.write_text(lab.source(solution=solution).read_text() + PRELUDE.format(mark=str(mark)) + code)
    try:
        return grade(lab.number, source=path, seed=1)
    finally:
        path.unlink()
        folder.rmdir()


def probes(mark: Path) -> list[dict[str, Any]]:
    said = [(mark / name).read_text() for name in sorted(os.listdir(mark)) if not name.endswith(".part")]
    return [json.loads(word[len("probe ") :]) for word in said if word.startswith("probe ")]


def test_a_planted_stdlib_module_in_the_graders_cwd_is_never_imported_and_no_learner_path_is_writable(
    no_nats_url: None, fresh_nursery: None, mark: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "cwd"
    planted.mkdir()
    planted.chmod(0o777)  # a folder the learner's user could write, as /tmp or a shared folder is
    for name in ("tomllib", "json", "secrets", "typing"):
        (planted / f"{name}.py").write_text(f"open({str(mark / ('planted-' + name))!r}, 'w').write('imported')\n")
    monkeypatch.chdir(planted)
    verdict = graded(LABS["01"], PROBE, mark)
    assert not verdict.passed  # the starter's own mistakes; the probe changes none of them
    assert not [name for name in os.listdir(mark) if name.startswith("planted-")], "a planted module was imported"
    seen = probes(mark)
    assert seen, "the probe never ran"
    paths = sysconfig.get_paths()
    allowed = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    for probe in seen:
        path = [os.path.realpath(entry) for entry in probe["path"]]
        assert str(planted) not in path and "" not in probe["path"]
        source, *rest = path
        assert Path(source).name == "src" and Path(source).parent.name.startswith("msglab-run-")
        assert all(p in allowed or os.path.dirname(p) in allowed or p.endswith(".zip") for p in rest), path
        if OWN_USER:  # as the grader's own user, the learner may write what that user may
            assert probe["writable"] == [], probe["writable"]


def test_no_secret_of_the_graders_environment_reaches_learner_code(
    no_nats_url: None, fresh_nursery: None, mark: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MSGLAB_FAKE_SECRET", SECRET)
    monkeypatch.setenv("CI_JOB_TOKEN", SECRET)
    monkeypatch.setenv("PYTHONSTARTUP", SECRET)
    verdict = graded(LABS["04"], PROBE, mark)
    assert not verdict.passed
    seen = probes(mark)
    assert seen, "the probe never ran"
    for probe in seen:
        environ = probe["environ"]
        assert isinstance(environ, dict)
        assert SECRET not in json.dumps(probe), probe
        assert {name for name in environ if not name.startswith("LC_")} <= LEARNER_ENV, environ
        assert "learner:" in environ["NATS_URL"]  # the run's restricted user, never the grader's
        # The initial block (set when the nursery was executed) holds only the nursery's allow-list.
        block = [entry.split("=", 1)[0] for entry in str(probe["self"]).split("\0") if entry]
        assert block and {name for name in block if not name.startswith("LC_")} <= NURSERY_ENV, probe["self"]


def test_the_allow_lists_drop_everything_else() -> None:
    grader = {"PATH": "/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "AWS_SECRET_ACCESS_KEY": "x", "MSGLAB_ROOT": "/c",
              "NATS_URL": "nats://admin:pw@127.0.0.1:4222", "MSGLAB_ROLE": "w", "HOME": "/run/home"}  # fmt: skip
    assert learner_environment(grader) == {"PATH": "/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "MSGLAB_ROLE": "w",
                                           "HOME": "/run/home"}  # fmt: skip
    assert nursery_environment(grader) == {"PATH": "/bin", "LANG": "C.UTF-8", "LC_ALL": "C"}


TAKE_THE_REFERENCE = """
from msglab.graders.backpressure import reference_age as _reference_age


async def queue_age(env) -> float:
    age, _count = await _reference_age(env.js, env.stream("ORDERS"), env.durable("fulfil"),
                                       env.subject("orders.placed"))
    return age
"""


def test_importing_a_graders_reference_fails_the_file_not_the_grader(no_nats_url: None, mark: Path) -> None:
    # Control: the starter's own queue_age fails lab 05 for its mistake.
    control = graded(LABS["05"], "", mark)
    assert not control.passed and "file_imports" not in {c.name for c in control.checks}
    verdict = graded(LABS["05"], TAKE_THE_REFERENCE, mark)
    assert not verdict.passed, verdict.to_text()
    [check] = verdict.checks
    assert check.name == "file_imports" and "ModuleNotFoundError" in check.message, verdict.to_text()
    assert "msglab.graders" in check.message


LEAVE_BEHIND = r"""
import ctypes, os, socket, sys
tag = sys.argv[1]
libc = ctypes.CDLL("libc.so.6", use_errno=True)
for where in ("/tmp", "/dev/shm"):
    with open(f"{where}/{tag}-8mb", "wb") as out:
        out.write(b"x" * (8 << 20))
open(f"/var/tmp/{tag}-file", "w").write("left")
os.mkfifo(f"/tmp/{tag}-fifo")
socket.socket(socket.AF_UNIX).bind(f"/tmp/{tag}-socket")
os.makedirs(f"/tmp/{tag}-tree/a/b")
open(f"/tmp/{tag}-tree/a/b/c", "w").write("deep")
os.symlink("/etc/passwd", f"/tmp/{tag}-tree/link")
open(sys.argv[2] + f"/{tag}-in-shared-folder", "w").write("left")  # a world-writable folder someone else owns
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
assert libc.shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0o600) >= 0
assert libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600) >= 0
assert libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600) >= 0
"""


def _ipc_of(uid: int) -> list[str]:
    found = []
    for kind, column in (("shm", 7), ("sem", 4), ("msg", 7)):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            if int(line.split()[column]) == uid:
                found.append(f"{kind} {line.split()[1]}")
    return found


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/python3").exists(), reason="needs root and a system Python")
def test_the_sweep_removes_files_fifos_sockets_and_ipc_the_runs_user_left_outside_its_folder(tmp_path: Path) -> None:
    import secrets
    import subprocess

    from msglab.grading.sandbox import UID_RANGE

    uid = secrets.SystemRandom().randint(*UID_RANGE)
    tag = f"msglab-leftover-{uid}"
    shared = Path(tempfile.mkdtemp(prefix="msglab-shared-folder-"))
    shared.chmod(0o1777)
    mine = Path(tempfile.gettempdir()) / f"{tag}-not-the-runs"  # the grader's own file, same name pattern
    mine.write_text("keep")
    try:
        subprocess.run(["/usr/bin/python3", "-c", LEAVE_BEHIND, tag, str(shared)], user=uid, group=uid,
                       extra_groups=[], check=True, cwd="/", timeout=60)  # fmt: skip
        left = [p for root in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(root).glob(f"{tag}-*") if p != mine]
        left += list(shared.iterdir())
        assert len(left) == 7 and len(_ipc_of(uid)) == 3, (left, _ipc_of(uid))  # the control: all of it is there
        Sandbox(uid=uid).sweep()
        assert [p for root in ("/tmp", "/var/tmp", "/dev/shm") for p in Path(root).glob(f"{tag}-*") if p != mine] == []
        assert list(shared.iterdir()) == [] and _ipc_of(uid) == []
        assert mine.read_text() == "keep" and Path("/etc/passwd").exists()
    finally:
        mine.unlink()
        subprocess.run(["rm", "-rf", str(shared)], check=False)


LITTER = """
def _litter(env):
    import ctypes, os, socket
    tag, key = {tag!r}, {key}
    wrote = {{"/tmp holds": sorted(os.listdir("/tmp"))}}
    for where, count, mb in (("/tmp", 3, 60), ("/dev/shm", 1, 8), ("/var/tmp", 1, 1), ("/run/lock", 2, 1)):
        wrote[where] = 0
        for i in range(count):
            try:
                with open(f"{{where}}/{{tag}}-{{os.getpid()}}-{{i}}", "wb") as out:
                    for _ in range(mb):
                        out.write(b"x" * (1 << 20))
                        wrote[where] += 1
            except OSError as exc:
                wrote[where + " stopped by"] = exc.strerror
    try:
        os.mkfifo(f"/tmp/{{tag}}-{{os.getpid()}}-fifo")
        socket.socket(socket.AF_UNIX).bind(f"/tmp/{{tag}}-{{os.getpid()}}-socket")
    except OSError as exc:
        wrote["fifo or socket"] = exc.strerror
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    wrote["shm"] = libc.shmget(key, 1 << 20, 0o1000 | 0o600)  # IPC_CREAT
    wrote["sem"] = libc.semget(key, 1, 0o1000 | 0o600)
    wrote["msg"] = libc.msgget(key, 0o1000 | 0o600)
    _report("litter " + __import__("json").dumps(wrote))
_hostile(_litter, once=True)
"""


def _sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


@pytest.mark.skipif(
    not OWN_USER,
    reason="learner code runs as the grader's own user (not root, or root whose Python other users cannot reach):"
    " its files in /tmp cannot be told from the grader's, and self-study accepts that (msglab/grading/sandbox.py)",
)
def test_what_a_run_writes_outside_its_folder_is_bounded_and_gone_after_the_verdict(
    no_nats_url: None, mark: Path
) -> None:
    import secrets

    tag, key = f"msglab-litter-{secrets.token_hex(4)}", secrets.randbelow(1 << 30) + 1
    verdict = graded(LABS["01"], LITTER.format(tag=tag, key=key), mark)
    assert not verdict.passed  # the starter's own mistakes
    said = [(mark / n).read_text() for n in os.listdir(mark) if not n.endswith(".part")]
    wrote = json.loads(next(word for word in said if word.startswith("litter "))[len("litter ") :])
    assert all(wrote[kind] >= 0 for kind in ("shm", "sem", "msg")), wrote  # the control: each was made
    left = [str(p) for root in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock") for p in Path(root).glob(f"{tag}*")]
    assert left == [], f"the run left {left}"
    assert key not in _sysv_keys(), "the run left System V IPC"
    # As root (a user of its own), the run's scratch is a bounded tmpfs of its own.
    assert wrote["/tmp"] <= 64 and "/tmp stopped by" in wrote, wrote
    assert wrote["/dev/shm"] <= 16, wrote
    assert wrote["/run/lock"] <= 1 and "/run/lock stopped by" in wrote, wrote  # on this disk, unbounded before
    # Nothing of the machine's /tmp is in sight (other runs' folders, the grader's files): only its own.
    others = [name for name in wrote["/tmp holds"] if not name.startswith(tag)]
    assert len(others) == 1 and others[0].startswith("msglab-run-"), others


FILL_THE_HOME = """
def _fill(env):
    import json, os
    home, mb, stopped = os.environ["HOME"], 0, ""
    try:
        for i in range(100):  # 20 MB files, each under the file size limit, up to 2 GB in all
            with open(os.path.join(home, f"fill-{os.getpid()}-{i}"), "wb") as out:
                for _ in range(20):
                    out.write(b"x" * (1 << 20))
                    out.flush()
                    mb += 1
            _report("filled " + json.dumps({"mb": mb, "mounted": os.path.ismount(home)}))
    except OSError as exc:
        stopped = exc.strerror
    _report("filled " + json.dumps({"mb": mb, "mounted": os.path.ismount(home), "stopped by": stopped}))
_hostile(_fill, once=True)
"""


def _filled(mark: Path) -> dict[str, Any]:
    """What the run's processes wrote into its home: MB in all (each process's last word), and how they ended."""
    last: dict[str, dict[str, Any]] = {}
    names = [name for name in os.listdir(mark) if not name.endswith(".part")]  # a kill mid-report leaves a part
    for name in sorted(names, key=lambda name: int(name.split("-")[1])):  # {pid}-{monotonic ns}
        word = (mark / name).read_text()
        if word.startswith("filled "):
            last[name.split("-")[0]] = json.loads(word[len("filled ") :])
    assert last, "the filler never ran"
    stopped = [word["stopped by"] for word in last.values() if "stopped by" in word]
    return {"mb": sum(word["mb"] for word in last.values()), "mounted": all(w["mounted"] for w in last.values()),
            "processes": len(last), **({"stopped by": stopped[0]} if stopped else {})}  # fmt: skip


def _run_mounts() -> list[str]:
    mine = f"{RUN_PREFIX}{os.getpid()}-"  # this process's runs (other processes grade at the same time)
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if mine in line]


@pytest.mark.skipif(not OWN_USER, reason="the grader mounts a run's bounded home only as root")
def test_what_a_run_writes_into_its_home_is_bounded_in_all_and_gone_after_the_verdict(
    no_nats_url: None, mark: Path
) -> None:
    verdict = graded(LABS["01"], FILL_THE_HOME, mark)
    assert not verdict.passed  # the starter's own mistakes
    filled = _filled(mark)
    # Each file is under the file size limit: only the home's own bound stops the writer (ENOSPC).
    assert filled["mounted"] and filled["mb"] <= 64 and filled["stopped by"] == "No space left on device", filled
    assert not list(Path(runs_folder()).glob(f"{RUN_PREFIX}{os.getpid()}-*")), "the run left its folder"
    assert _run_mounts() == [], "the run left its home mounted"


def test_where_the_kernel_will_not_bound_the_home_the_zygote_stops_a_run_past_the_bound(
    no_nats_url: None, mark: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from msglab.grading import harness

    monkeypatch.setattr(harness, "bounded_home", lambda path, uid: False)  # as without CAP_SYS_ADMIN
    verdict = graded(LABS["01"], FILL_THE_HOME, mark)
    filled = _filled(mark)
    text = verdict.to_text()
    assert not verdict.passed and not filled["mounted"], text
    assert "stopped by" not in filled, filled  # it never got an error: it was stopped while writing
    # Reported every 20 MB: it was not stopped below the bound, nor left to write its 2 GB.
    assert 60 <= filled["mb"] < 2000, filled
    # Under a full suite's load the verdict sometimes names a SIGKILL "(not by the grader)" instead (2 runs of
    # 3): the zygote's exit report for that process is lost or unattributed, an open defect of the wording
    # only; the bound itself held (above).
    assert "file size limit (64 MB a file, 64 MB in its folder in all)" in text or "SIGKILL" in text, text
    assert not list(Path(runs_folder()).glob(f"{RUN_PREFIX}{os.getpid()}-*")), "the run left its folder"


@pytest.mark.skipif(not OWN_USER, reason="the grader mounts a run's bounded home only as root")
def test_a_killed_graders_bounded_home_is_unmounted_and_removed_by_the_next_run(tmp_path: Path) -> None:
    import subprocess

    from msglab.grading.harness import sweep_stale_runs
    from msglab.grading.sandbox import bounded_home

    dead = subprocess.Popen(["true"])  # a pid that no longer runs, as a killed grader's
    dead.wait()
    folder = tmp_path / f"{RUN_PREFIX}{dead.pid}-left"
    (folder / "home").mkdir(parents=True)
    assert bounded_home(str(folder / "home"), 3_000_001)
    (folder / "home" / "work.sqlite").write_bytes(b"x" * 4096)
    assert os.path.ismount(folder / "home")  # the control: what a killed grader leaves
    assert sweep_stale_runs(str(tmp_path)) == [str(folder)]
    assert not folder.exists()
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(folder) in line]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user")
def test_the_watch_counts_the_whole_home_and_what_the_runs_user_owns_in_a_shared_scratch(tmp_path: Path) -> None:
    from msglab.grading.sandbox import FOLDER_FILES, FOLDER_MB, MB, over_bound, written

    uid = 3_000_002
    home, shared = tmp_path / "home", tmp_path / "shared"
    home.mkdir()
    shared.mkdir()
    shared.chmod(0o1777)
    (home / "shop.sqlite").write_bytes(b"x" * 8192)
    with open(home / "sparse", "wb") as out:  # 1 GB long, nothing written: it takes no room
        out.truncate(1 << 30)
    (shared / "mine").write_bytes(b"x" * 16384)
    os.chown(shared / "mine", uid, uid)
    (shared / "theirs").write_bytes(b"x" * (1 << 20))  # another user's: not the run's
    used, entries = written(str(home), uid, (str(shared),))
    assert entries == 3 and 8192 + 16384 <= used < 1 << 20, (used, entries)
    assert written(str(home), None, (str(shared),))[1] == 2  # without a user of its own, only the home
    assert not over_bound(used, entries)
    assert over_bound(FOLDER_MB * MB + 1, 1) and over_bound(0, FOLDER_FILES + 1)
