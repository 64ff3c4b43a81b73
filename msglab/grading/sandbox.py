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
- **A private scratch** with a user of its own: the run's zygote enters a mount and IPC namespace
  of its own with bounded tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock (the run's folder bound back in), so
  what a run writes there is bounded in total and vanishes with it, System V IPC too; where the kernel
  refuses (no CAP_SYS_ADMIN), the end-of-run sweep removes every file and IPC object of the run's uid.
- **A bounded home**: the run's home (the learner's HOME and TMPDIR, which the grader reads too) is a
  tmpfs of FOLDER_MB mounted by the grader itself (`bounded_home`), so a write past the bound fails with
  ENOSPC; it is unmounted with the run's folder (`remove_run_folder`, also for a killed grader's leftovers).
  Where the kernel refuses, the run's zygote watches the folder (`written`) and stops every process of the
  run once it holds more than FOLDER_MB or FOLDER_FILES entries (reported as the file size limit's signal).
- **A tag** in every learner process's environment (MSGLAB_RUN_ID): without root there is no
  uid of its own, so the end-of-run sweep also kills every process that carries the run's tag.
  (A process that execs with a clean environment AND leaves its session escapes this sweep when
  the grader is not root; self-study accepts that, graded submissions run as root.)

Learner files are copied into the run's own folder before they run, so a learner process
never needs the course tree, and the graded copy cannot be swapped during the run.

What a learner process inherits is allow-listed too: its environment (`learner_environment`: never
the grader's secrets or an admin's NATS_URL), its import path (`learner_path`: the standard
library, site-packages and its run's source folder, none of which its user can write) and what it
may import (`seal_course`: not the graders, course services, demos or classroom tools, which hold
the labs' answers and the services' internals).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

MB = 1 << 20
LIMITS = {  # per learner process
    "address space": (resource.RLIMIT_AS, 1024 * MB),
    "CPU time": (resource.RLIMIT_CPU, 20),  # seconds of CPU; a verdict uses well under one
    "file size": (resource.RLIMIT_FSIZE, 64 * MB),
    "open files": (resource.RLIMIT_NOFILE, 256),
    "core dumps": (resource.RLIMIT_CORE, 0),
}
NPROC = 64  # processes of the sandbox user, only with a uid of its own
FOLDER_MB = 64  # what a run's processes may write into its home, in all (a lab writes a small database)
FOLDER_FILES = 10_000  # entries (files, folders, links) they may make there
SCAN_LIMIT = 50_000  # entries one look may read, the run's or others' (shared scratch folders)
WATCH_INTERVAL = 0.02  # seconds between two looks at a home the kernel would not bound (the zygote's watch)
UID_RANGE = (3_000_000, 3_999_999)  # no account uses these; a fresh one per run
SIGNAL_LIMITS = {signal.SIGXCPU: "CPU time", signal.SIGXFSZ: "file size"}


# What a learner process's environment may hold, whatever the grader's holds (CI tokens, admin URLs).
LEARNER_ENV = frozenset(
    {
        "MSGLAB_GRADER", "MSGLAB_ROLE", "MSGLAB_SOURCE", "MSGLAB_RUN_ID", "MSGLAB_INBOX", "MSGLAB_PREFIX",
        "MSGLAB_PARAMS", "MSGLAB_FX_FD", "NATS_URL", "NATS_CA", "HOME", "TMPDIR", "PATH", "LANG", "TZ",
        "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
    }
)  # fmt: skip
NURSERY_ENV = frozenset({"PATH", "LANG", "TZ"})  # the nursery needs no msglab variable: spawns bring theirs
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# The course's own code that learner code may not import: graders hold the labs' references,
# course services their internals (msglab.grading's runner, labkit and effects stay importable).
SEALED = ("msglab.graders", "msglab.world", "msglab.demos", "msglab.classroom")


def _allowed(name: str, allowed: frozenset[str]) -> bool:
    return name in allowed or name.startswith("LC_")


def learner_environment(env: dict[str, str]) -> dict[str, str]:
    """Only the variables a learner process needs, from what the grader passes (never an admin's URL)."""
    from msglab.broker.users import LEARNER, LEARNER_INBOX, admin_password_of

    kept = {name: value for name, value in env.items() if _allowed(name, LEARNER_ENV)}
    url = kept.get("NATS_URL", "")
    if admin_password_of(url):
        del kept["NATS_URL"]
    elif urlsplit(url.split(",")[0].strip()).username == LEARNER and not kept.get("MSGLAB_INBOX"):
        kept["MSGLAB_INBOX"] = LEARNER_INBOX  # a run's own server: the learner user reads only this inbox
    kept.setdefault("PATH", DEFAULT_PATH)
    return kept


def nursery_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the nursery is executed with: every learner process can read it (/proc/self/environ)."""
    kept = {name: value for name, value in (os.environ if env is None else env).items() if _allowed(name, NURSERY_ENV)}
    kept.setdefault("PATH", DEFAULT_PATH)
    return kept


def learner_path(source_folder: str) -> list[str]:
    """A learner process's sys.path: its run's source folder, then the standard library and site-packages."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")}
    packages = {os.path.realpath(paths[key]) for key in ("purelib", "platlib")}
    packages |= {os.path.realpath(folder) for folder in site.getsitepackages()}
    zipped = {os.path.dirname(folder) for folder in stdlib}  # the zipped stdlib sits beside it
    kept = [source_folder]
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        wanted = real in stdlib | packages or os.path.dirname(real) in stdlib  # lib-dynload sits inside
        if (wanted or (real.endswith(".zip") and os.path.dirname(real) in zipped)) and entry not in kept:
            kept.append(entry)
    return kept


def _sealed(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in SEALED)


class _SealedFinder:
    """A meta-path finder that refuses the course's sealed packages."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if _sealed(name):
            raise ModuleNotFoundError(
                f"No module named {name!r} (the course's own code is not for learner code)", name=name
            )
        return None


def seal_course() -> None:
    """Make the sealed packages unimportable in this process (call after the runner holds its grader)."""
    for name in [name for name in sys.modules if _sealed(name)]:
        del sys.modules[name]
    package = sys.modules.get("msglab")
    for name in SEALED:  # `import msglab; msglab.graders` would reach them through the parent's attributes
        if package is not None:
            package.__dict__.pop(name.rsplit(".", 1)[1], None)
    if not any(isinstance(finder, _SealedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SealedFinder())


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
        found = kill_tagged(self.run_id)
        if self.uid is not None:  # its processes are gone: nothing can make more
            sweep_files(self.uid)
            sweep_ipc(self.uid)
        return found


# A run's private scratch folders (tmpfs in a mount namespace of its own; `private_scratch`), in MB:
# what every learner process of the run may write there in total. They vanish with the run. /run/lock is
# world-writable too, and on some machines it sits on the real disk (a plain folder of /).
PRIVATE_SCRATCH = {"/tmp": 64, "/var/tmp": 16, "/dev/shm": 16, "/run/lock": 1}
CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def private_scratch(run_folder: str) -> bool:
    """Give this process (a run's zygote, as root) and its children their own /tmp, /var/tmp, /dev/shm
    and System V IPC: bounded tmpfs that vanish with the run, the run's folder bound back in place.

    Returns False, changing nothing, where the kernel refuses (no CAP_SYS_ADMIN, e.g. an unprivileged
    container): the end-of-run sweep is then what removes what the run left.
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return False
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        return False
    # Nothing mounted here may propagate back to the machine's own mount table.
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    # Opened in the new namespace (a bind from another namespace's mount is refused), before /tmp is covered:
    # the run's folder, and the Python and course the learner's process imports from, wherever they
    # sit (a venv in /tmp, a grading platform's folder there) — covered, they could not be imported.
    import msglab

    wanted = [run_folder, sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(msglab.__file__))]
    keep = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in dict.fromkeys(wanted) if os.path.isdir(path)}
    try:
        for folder, megabytes in PRIVATE_SCRATCH.items():
            if not os.path.isdir(folder):
                continue
            options = f"size={megabytes}m,mode=1777".encode()
            if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
                continue
            for path, fd in keep.items():
                if path.startswith(folder + os.sep):
                    os.makedirs(path, mode=0o711, exist_ok=True)
                    # Recursive: the run's bounded home is a mount of its own inside the run's folder.
                    libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None)
        return True
    finally:
        for fd in keep.values():
            os.close(fd)


MNT_DETACH = 2


def bounded_home(path: str, uid: int) -> bool:
    """Mount a tmpfs of FOLDER_MB (FOLDER_FILES entries) owned by `uid` on `path`, an empty folder: the run's
    home, before anything is written there. Mounted by the grader in its own mount namespace, so the grader
    and the run's processes (the zygote binds the run's folder back recursively) see the same files.

    Returns False, changing nothing, where the kernel refuses (not root, no CAP_SYS_ADMIN): the run's
    zygote then watches the folder instead (`written`).
    """
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    options = f"size={FOLDER_MB}m,nr_inodes={FOLDER_FILES},mode=0700,uid={uid},gid={uid}".encode()
    return libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) == 0


def mounts_under(folder: str) -> list[str]:
    """Mount points inside `folder` (deepest last), from this process's mount table."""
    prefix = os.path.realpath(folder) + os.sep
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [_unescape(line.split()[4]) for line in lines if len(line.split()) > 4]
    return sorted({point for point in points if point.startswith(prefix)}, key=len)


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)


def remove_run_folder(folder: str) -> None:
    """Remove a run's folder: unmount its bounded home (and anything else mounted inside) first."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        for point in reversed(mounts_under(folder)):
            libc.umount2(point.encode(), MNT_DETACH)
    shutil.rmtree(folder, ignore_errors=True)


def written(folder: str, uid: int | None = None, roots: tuple[str, ...] = ()) -> tuple[int, int]:
    """(bytes, entries) a run holds in its home `folder`, and in `roots` (shared scratch folders) what `uid`
    owns there; the walk stops once it has counted more than FOLDER_FILES entries (or looked at SCAN_LIMIT
    of anyone's: a crowded shared /tmp must not make each look slow). Bytes are allocated blocks, so a
    sparse file counts what it really takes."""
    used = entries = scanned = 0
    stack = [(folder, True)] + [(root, False) for root in roots if uid is not None]
    stack.reverse()  # the home first
    while stack and entries <= FOLDER_FILES and scanned <= SCAN_LIMIT:
        where, everything = stack.pop()
        try:
            found = list(os.scandir(where))
        except OSError:
            continue
        scanned += len(found)
        for entry in found:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            mine = everything or info.st_uid == uid
            if mine:
                used += info.st_blocks * 512
                entries += 1
            if stat.S_ISDIR(info.st_mode) and (mine or info.st_mode & stat.S_IWOTH):
                stack.append((entry.path, mine))
    return used, entries


def over_bound(used: int, entries: int) -> bool:
    """A home past what a run may write (FOLDER_MB, FOLDER_FILES)."""
    return used > FOLDER_MB * MB or entries > FOLDER_FILES


# Where any user may create files outside its run folder (world-writable, or so on most systems).
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock")


def sweep_files(uid: int, roots: tuple[str, ...] = SCRATCH) -> list[str]:
    """Remove every file, folder, FIFO or socket `uid` owns in the scratch folders; return their paths.

    A user with no groups can create entries only in folders it owns (removed whole) or in
    world-writable ones, so only those are searched: the walk stays short however full /tmp is.
    """
    removed: list[str] = []
    folders = [root for root in roots if os.path.isdir(root)]
    while folders:
        folder = folders.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            is_folder = stat.S_ISDIR(info.st_mode)
            if info.st_uid == uid:
                with contextlib.suppress(OSError):
                    if is_folder:
                        shutil.rmtree(entry.path)  # never follows a symlink out of the folder
                    else:
                        os.unlink(entry.path)
                    removed.append(entry.path)
            elif is_folder and info.st_mode & stat.S_IWOTH:
                folders.append(entry.path)
    return removed


IPC_RMID = 0


def sweep_ipc(uid: int) -> list[str]:
    """Remove every System V shared-memory segment, semaphore set and message queue `uid` created or owns."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    removed = []
    # /proc/sysvipc/<kind>: the id, then the owner's and creator's uid at these columns
    for kind, remove, uid_columns in (
        ("shm", lambda ident: libc.shmctl(ident, IPC_RMID, None), (7, 9)),
        ("sem", lambda ident: libc.semctl(ident, 0, IPC_RMID), (4, 6)),
        ("msg", lambda ident: libc.msgctl(ident, IPC_RMID, None), (7, 9)),
    ):
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            owners = {int(fields[column]) for column in uid_columns if column < len(fields)}
            if uid in owners and remove(int(fields[1])) == 0:
                removed.append(f"{kind} {fields[1]}")
    return removed


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
    if name == "file size":
        return f"{limit // MB} MB a file, {FOLDER_MB} MB in its folder in all"
    if name == "address space":
        return f"{limit // MB} MB"
    return str(limit)
