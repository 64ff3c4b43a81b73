"""How a learner process is confined: limits, its own session, an unprivileged user, a sweep.

The mechanism, chosen deliberately: plain POSIX, set up between fork and exec of each learner
process (no container engine, no user namespaces, which this course cannot count on having):

- **Limits** (setrlimit): address space, CPU seconds, file size, open files, core dumps off;
  the number of processes too when the process has a user of its own (the kernel counts that
  limit per user, so it would cap the learner's whole desktop otherwise).
- **Its own session** (setsid): the grader SIGKILLs the whole process group at the end, and the
  parent-death signal is SIGKILL (it cannot be ignored), set after the user change because a
  change of credentials clears it.
- **An unprivileged user of its own** when the grader runs as root (classrooms, autograders,
  containers): a fresh numeric uid per run, no groups. It cannot write the course, its virtual
  environment or other learners' files (root-owned), cannot read `solutions/` (the grader
  makes that folder 0700), cannot read the run's server config or signal the grader. At the
  end the grader kills every process of that uid (`kill -9 -1` as that uid), which catches
  children that detached or double-forked into sessions of their own.
- **A tag** in every learner process's environment (MSGLAB_RUN_ID): without root there is no
  uid of its own, so the end-of-run sweep also kills every process that carries the run's tag.
  (A process that execs with a clean environment AND leaves its session escapes this sweep when
  the grader is not root; self-study accepts that, graded submissions run as root.)

Learner files are copied into the run's own folder before they run, so a learner process
never needs the course tree, and the graded copy cannot be swapped during the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MB = 1 << 20
LIMITS = {  # per learner process
    "address space": (resource.RLIMIT_AS, 1024 * MB),
    "CPU time": (resource.RLIMIT_CPU, 20),  # seconds of CPU; a verdict uses well under one
    "file size": (resource.RLIMIT_FSIZE, 64 * MB),
    "open files": (resource.RLIMIT_NOFILE, 256),
    "core dumps": (resource.RLIMIT_CORE, 0),
}
NPROC = 64  # processes of the sandbox user, only with a uid of its own
UID_RANGE = (3_000_000, 3_999_999)  # no account uses these; a fresh one per run
SIGNAL_LIMITS = {signal.SIGXCPU: "CPU time", signal.SIGXFSZ: "file size"}


def _prctl_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 == PR_SET_PDEATHSIG


@dataclass
class Sandbox:
    """The confinement of one run's learner processes."""

    run_id: str = field(default_factory=lambda: secrets.token_hex(6))
    uid: int | None = None  # a user of its own (only when the grader is root)
    why_not: str = ""  # why learner code runs as the grader's user, when it does

    @classmethod
    def for_this_machine(cls) -> Sandbox:
        """A uid of its own when running as root on Linux (and Python is usable by other users)."""
        if not sys.platform.startswith("linux") or os.geteuid() != 0:
            return cls(why_not="learner code as your own user (the grader is not root)")
        if os.environ.get("MSGLAB_SANDBOX_USER", "1") == "0":
            return cls(why_not="learner code as root (MSGLAB_SANDBOX_USER=0)")
        blocked = unreachable_for_others()
        if blocked:
            return cls(why_not=f"learner code as root: {blocked} is closed to other users")
        return cls(uid=secrets.SystemRandom().randint(*UID_RANGE))

    def preexec(self) -> None:
        """Runs in the child between fork and exec (after setsid)."""
        for key, limit in LIMITS.values():
            with contextlib.suppress(ValueError, OSError):  # a limit already lower stays as it is
                resource.setrlimit(key, (limit, limit))
        if self.uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        if sys.platform.startswith("linux"):
            _prctl_death_signal(signal.SIGKILL)

    def give(self, path: Path) -> None:
        """Make a folder the learner process may write (its HOME and TMPDIR)."""
        if self.uid is not None:
            os.chown(path, self.uid, self.uid)

    def sweep(self) -> int:
        """Kill every process left from this run; return how many were found by their tag."""
        if self.uid is not None:
            # kill(-1) as that uid reaches every process it owns (and never the caller itself).
            kill = shutil.which("kill") or "/bin/kill"
            subprocess.run([kill, "-9", "-1"], user=self.uid, group=self.uid, extra_groups=[],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)  # fmt: skip
        return kill_tagged(self.run_id)


def unreachable_for_others() -> str:
    """The first path a user of its own would need (Python, the stdlib, msglab, nats) but cannot reach, or ''."""
    import nats

    import msglab

    needed = [Path(os.path.realpath(sys.executable)), Path(os.__file__), Path(msglab.__file__), Path(nats.__file__)]
    for path in needed:
        path = path.resolve()
        for folder in path.parents:
            if not folder.stat().st_mode & 0o001:  # others may not traverse it
                return str(folder)
        if not path.stat().st_mode & 0o004:
            return str(path)
    return ""


def kill_tagged(run_id: str) -> int:
    """SIGKILL every process whose environment carries MSGLAB_RUN_ID=run_id."""
    tag = f"MSGLAB_RUN_ID={run_id}".encode()
    found = 0
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if tag in environ.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                found += 1
    return found


def protect_solutions(root: Path) -> None:
    """Make solutions/ unreadable to other users (only meaningful when grading as root)."""
    folder = root / "solutions"
    if folder.is_dir() and os.geteuid() == 0 and folder.stat().st_mode & 0o077:
        folder.chmod(0o700)


def limit_hit(returncode: int | None, died: dict[str, str] | None) -> str:
    """Which limit a learner process ran into, in words, or ''."""
    if returncode is not None and returncode < 0:
        name = SIGNAL_LIMITS.get(signal.Signals(-returncode))
        if name:
            return f"{name} limit ({_amount(name)})"
    error = (died or {}).get("error", "")
    message = (died or {}).get("message", "")
    if error == "MemoryError":
        return f"address space limit ({_amount('address space')})"
    if "Too many open files" in message:
        return f"open files limit ({_amount('open files')})"
    if error == "BlockingIOError" and "Resource temporarily unavailable" in message:
        return f"process limit ({NPROC} processes)"
    return ""


def _amount(name: str) -> str:
    limit = LIMITS[name][1]
    if name == "CPU time":
        return f"{limit} s of CPU"
    if name in ("address space", "file size"):
        return f"{limit // MB} MB"
    return str(limit)
