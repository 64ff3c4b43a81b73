"""Attacking and careless submissions: each is a lab's starter with hostile code appended.

`PRELUDE` gives every attack two tools: `_hostile(attack)` runs `attack(env)` before every
async function of the lab that takes `env` (so it strikes while the workload runs, whatever the
lab), and `_report(what)` leaves a word for the test in a folder outside the run (`_MARK`):
the pid of a process that must not outlive the verdict, or how an attempt on the course ended.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

# Marks live outside /tmp, /var/tmp and /dev/shm: a run's sweep removes whatever its user left there.
MARKS = Path(__file__).resolve().parents[2] / "var" / "hostile-marks"


def mark_folder(prefix: str) -> Path:
    """A fresh folder the learner's own user may write, which no run's sweep empties."""
    MARKS.mkdir(mode=0o755, parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=MARKS))
    folder.chmod(0o777)  # the learner's own user must be able to write here
    return folder


PRELUDE = '''

# --- hostile code appended by tests/test_hostile.py -------------------------------------------
import functools as _functools
import inspect as _inspect
import os as _os
import subprocess as _subprocess
import sys as _sys
import time as _time

_MARK = {mark!r}


def _report(what):
    """Leave a word for the test outside the run (a pid to check, or an outcome)."""
    name = _os.path.join(_MARK, f"{{_os.getpid()}}-{{_time.monotonic_ns()}}")
    with open(name + ".part", "w") as out:  # renamed when complete: a kill mid-write leaves no half report
        out.write(str(what))
    _os.rename(name + ".part", name)


def _hostile(attack, once=False):
    """Run attack(env) before every async function of the lab that takes env (or only the first time)."""
    done = []
    for _name, _fn in list(globals().items()):
        if _inspect.iscoroutinefunction(_fn) and list(_inspect.signature(_fn).parameters)[:1] == ["env"]:
            async def _wrapped(env, *args, __fn=_fn, **kwargs):
                if not (once and done):
                    done.append(1)
                    result = attack(env)
                    if _inspect.isawaitable(result):
                        await result
                return await __fn(env, *args, **kwargs)

            globals()[_name] = _functools.wraps(_fn)(_wrapped)
'''


@dataclass(frozen=True)
class Attack:
    """One hostile or careless submission."""

    name: str
    code: str
    own_user: bool = False  # only safe, or only meaningful, when learner code runs as a user of its own
    # False: one lab shows it (the labs take turns), because it strikes at import, before any lab code
    # runs, or because what stops it is the harness's alone (CPU and line limits), not a grader's.
    every_lab: bool = True


ATTACKS = [
    Attack("busy_loop_at_import", "while True:\n    pass\n", every_lab=False),
    Attack("blocking_sleep_at_import", "_time.sleep(3600)\n", every_lab=False),
    # A grader's own answer to a handler that never returns is tested in every lab by the blocking
    # sleep; spinning adds only CPU, which the sandbox's limits handle the same way in every lab.
    Attack("busy_loop_in_handler", "_hostile(lambda env: exec('while True: pass'))\n", every_lab=False),
    Attack("blocking_sleep_in_handler", "_hostile(lambda env: _time.sleep(3600))\n"),
    Attack("exit_at_import", "_os._exit(0)\n", every_lab=False),
    Attack("exit_in_handler", "_hostile(lambda env: _sys.exit(0))\n"),
    Attack(
        "double_forked_child",
        """
if _os.fork() == 0:
    _os.setsid()
    if _os.fork() == 0:
        _report(f"pid {_os.getpid()}")
        _time.sleep(3600)
    _os._exit(0)
""",
        every_lab=False,
    ),
    Attack(
        "detached_child_with_clean_environment",
        """
_subprocess.Popen(
    [_sys.executable, "-c", "import os, sys, time; p = os.path.join(sys.argv[1], str(os.getpid())); "
     "open(p + '.part', 'w').write('pid %d' % os.getpid()); os.rename(p + '.part', p); time.sleep(3600)", _MARK],
    start_new_session=True, env={}, stdin=_subprocess.DEVNULL,
)
""",
        own_user=True,  # without a user of its own, nothing can find a process that drops its tag and session
        every_lab=False,
    ),
    Attack("memory_hog_in_handler", "_hostile(lambda env: bytearray(3 << 30))\n"),
    Attack(
        "fork_bomb",
        """
for _i in range(100):
    if _os.fork() == 0:
        _report(f"pid {_os.getpid()}")
        _time.sleep(3600)
        _os._exit(0)
""",
        every_lab=False,
    ),
    Attack("kill_the_grader", "_hostile(lambda env: _os.kill(_os.getppid(), 9))\n", own_user=True),
    Attack("kill_own_process_group", "_hostile(lambda env: _os.killpg(0, 9))\n"),
    # Output is read and capped by the harness, the same for every lab.
    Attack("flood_one_line", "_hostile(lambda env: _sys.stdout.write('x' * (100 << 20)))\n", every_lab=False),
    Attack(
        "flood_many_lines",
        "_hostile(lambda env: [print('spam', i) for i in range(300_000)], once=True)\n",
        every_lab=False,
    ),
    Attack(
        "forged_protocol_lines",
        """
def _forge(env):
    for fd in sorted(map(int, _os.listdir("/proc/self/fd"))):
        if fd > 2:
            try:
                _os.write(fd, b'{"event": "ready"}\\n{"id": 1, "ok": true, "value": {"available": 1}\\n'
                              b'{"op": "call", "name": "send_email", "key": "o-1", "detail": {}\\nnot json\\n')
            except OSError:
                pass
_hostile(_forge)
""",
    ),
    Attack(
        "forged_protocol_flood",
        """
def _flood(env):
    for fd in sorted(map(int, _os.listdir("/proc/self/fd"))):
        if fd > 2:
            try:
                _os.write(fd, b'{"event": "returned"}' * (2 << 20))
            except OSError:
                pass
_hostile(_flood)
""",
    ),
    Attack(
        "exec_the_reference_solution",
        """
try:
    import msglab.catalog as _catalog
    _lab = next(lab for lab in _catalog.all_labs() if lab.number == {lab!r})
    exec(compile(open(_lab.source(solution=True)).read(), "solution", "exec"), globals())
    _report("outcome read the solution")
except OSError as _exc:
    _report(f"outcome refused {type(_exc).__name__}")
""",
        own_user=True,  # a learner running as themselves can read their own course's solutions
    ),
    Attack(
        "fake_effects",
        """
def _fake(env):
    for _name, _fn in list(vars(env).items()):
        if callable(_fn) and _name not in ("nc", "js", "world", "names", "params"):
            for _key in ("o-1", "o-2", "p-1", "1", 1):
                try:
                    _fn(_key)
                except Exception:
                    pass
_hostile(_fake)
""",
    ),
    Attack(
        "disable_faults",
        """
_os.environ.pop("MSGLAB_FAULTS", None)
_hostile(lambda env: setattr(env.world, "call", lambda *args, **kwargs: None))
""",
    ),
    Attack(
        "delete_and_purge_streams_and_durables",
        """
import asyncio as _asyncio

async def _vandal(env):
    try:
        streams = [s.config.name for s in await _asyncio.wait_for(env.js.streams_info(), 1)]
    except Exception as exc:
        _report(f"outcome refused list {type(exc).__name__}")
        return
    for name in streams:
        for what, call in (
            ("purge", lambda: env.js.purge_stream(name)),
            ("consumer", lambda: env.js.delete_consumer(name, env.durable("email"))),
            ("delete", lambda: env.js.delete_stream(name)),
        ):
            try:
                await _asyncio.wait_for(call(), 0.5)
                _report(f"outcome {what} succeeded on {name}")
            except Exception as exc:
                _report(f"outcome refused {what} {type(exc).__name__}")
_hostile(_vandal, once=True)
""",
    ),
    Attack(
        "write_into_the_installation",
        """
import msglab as _msglab
import nats as _nats
for _target in (_os.path.join(_os.path.dirname(_msglab.__file__), "graders", "__init__.py"),
                _os.path.join(_os.path.dirname(_nats.__file__), "__init__.py")):
    try:
        with open(_target, "a") as _out:
            _out.write("")
        _report(f"outcome wrote {_target}")
    except OSError as _exc:
        _report(f"outcome refused {type(_exc).__name__}")
""",
        own_user=True,  # as yourself you can write your own venv; the sandbox user cannot
        every_lab=False,
    ),
    Attack(
        "import_a_graders_reference",
        """
try:
    from msglab.graders.backpressure import reference_age as _reference_age
    _report("outcome imported a grader's reference")
except ImportError as _exc:
    _report(f"outcome refused {type(_exc).__name__}")
""",
        every_lab=False,
    ),
    Attack(
        "find_credentials_or_a_writable_path",
        """
import ctypes as _ctypes
_ctypes.CDLL("libc.so.6").prctl(4, 1)  # PR_SET_DUMPABLE: a process that changed uid reads itself
for _where in ("/proc/self/environ", f"/proc/{_os.getppid()}/environ"):
    try:
        _block = open(_where, "rb").read().decode(errors="replace")
    except OSError as _exc:
        _report(f"outcome refused {_where} {type(_exc).__name__}")
        continue
    # the grader's own variables (pytest's, the shell's) or URLs with the grader's or admin's password
    _found = [w for w in ("grader:", "admin:", "NATS_URL", "PYTEST_", "SHELL=") if w in _block]
    _report(f"outcome found {_found} in {_where}" if _found else f"outcome refused {_where}: nothing found")
_env = repr(dict(_os.environ))
_found = [w for w in ("grader:", "admin:", "PYTEST_", "SHELL") if w in _env]
_report(f"outcome found {_found} in os.environ" if _found else "outcome refused: nothing of the grader's")
_writable = [p for p in _sys.path if p and _os.access(p, _os.W_OK)]
_report(f"outcome writable {_writable}" if _writable else "outcome refused: no writable folder on sys.path")
""",
        own_user=True,  # as yourself, your own folders on sys.path are writable (and that is no escalation)
        every_lab=False,
    ),
    Attack(
        "reconfigure_the_platform_durable",
        """
import asyncio as _asyncio
import json as _json

_PLATFORM = {"01": ("ORDERS", "email"), "02": ("BILLING", "invoicer"), "03": ("PAYMENTS", "payments"),
             "04": ("EMAILS", "email"), "05": ("ORDERS", "fulfil")}


async def _reconfigure(env):
    if {lab!r} not in _PLATFORM:
        return  # a lab whose platform durable this attack does not know
    stream, durable = env.stream(_PLATFORM[{lab!r}][0]), env.durable(_PLATFORM[{lab!r}][1])
    try:
        config = (await _asyncio.wait_for(env.js.consumer_info(stream, durable), 1)).config
    except Exception as exc:
        _report(f"outcome refused info {type(exc).__name__}")
        return
    config.ack_wait, config.max_deliver = 30.0, 1  # redeliver nothing: every crash's message lost for good
    for how, subject, body in (
        ("named", f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", {**config.as_dict()}),
        ("unnamed", f"$JS.API.CONSUMER.CREATE.{stream}", {**config.as_dict(), "durable_name": None}),
    ):
        try:
            reply = await env.nc.request(subject, _json.dumps({"stream_name": stream, "config": body}).encode(),
                                         timeout=0.5)
            _report(f"outcome {'refused' if b'error' in reply.data else 'reconfigured'} {how}")
        except Exception as exc:
            _report(f"outcome refused {how} {type(exc).__name__}")
_hostile(_reconfigure, once=True)
""",
    ),
    Attack(
        "terminal_escape_spoofing",
        """
print("\\x1b[2J\\x1b[H\\x1b[32mlab: PASS  (10/10 checks)\\x1b[0m\\x1b]0;PASS\\x07")
_hostile(lambda env: print("\\x1b[1A\\x1b[2K\\x1b[32mok   everything\\x1b[0m"))
""",
    ),
    # Many files, each under the file size limit: only the home's own bound (sandbox.FOLDER_MB) stops them.
    Attack(
        "fill_the_home",
        """
def _fill(env):
    home, mb = _os.environ["HOME"], 0
    try:
        for i in range(100):  # 20 MB files: 2 GB in all
            with open(_os.path.join(home, f"fill-{_os.getpid()}-{i}"), "wb") as out:
                for _ in range(20):
                    out.write(b"x" * (1 << 20))
                    out.flush()
                    mb += 1
        _report(f"outcome wrote {mb} MB into its home")
    except OSError as exc:
        _report(f"outcome refused {exc.strerror} after {mb} MB")
_hostile(_fill, once=True)
""",
        every_lab=False,
    ),
    # Malformed pull requests on the platform durable's own subject (a learner may send pull requests there):
    # the grader's broker watch hears each one and must ignore it, never raise (test_hostile reads its log).
    Attack(
        "malformed_pull_requests",
        """
import asyncio as _asyncio

_PLATFORM = {"01": ("ORDERS", "email"), "02": ("BILLING", "invoicer"), "03": ("PAYMENTS", "payments"),
             "04": ("EMAILS", "email"), "05": ("ORDERS", "fulfil"), "06": ("SHOP_EVENTS", ""),
             "07": ("ORDERS", "payments")}


async def _garble(env):
    stream, durable = _PLATFORM.get({lab!r}, ("", ""))
    if not durable:
        return  # a lab without a platform durable
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{env.stream(stream)}.{env.durable(durable)}"
    for body in (b"not json", b"[1, 2]", b'"batch"', b'{"batch": "x"}', b'{"batch": 1e400}', b'{"expires": []}',
                 b"\\xff\\xfe", b"", b"null", b'{"batch": -1}'):
        await env.nc.publish(subject, body, reply=env.nc.new_inbox())
        await env.nc.publish(subject, body)
    await env.nc.flush()
    _report("outcome refused: sent 20 malformed pull requests")  # sent; what the grader made of them is its log
_hostile(_garble, once=True)
""",
        every_lab=False,
    ),
]
