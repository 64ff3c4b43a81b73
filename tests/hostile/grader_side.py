"""Tricks on the grader's own side of a run (issue 15), appended to a wrong file after attacks.PRELUDE.

Each is graded beside its control, the same wrong file without the trick (tests/test_hostile_grader.py):
with the trick the file must still fail, for its own mistake or because the trick was refused.
"""

from __future__ import annotations

# Another run's submission: report this run's source, wait for another run's report, then try to list
# the folder run folders sit in and read the other run's source (and, as the control, its own).
READ_ANOTHER_RUN = """
import json as _json


def _snoop(env):
    mine = _os.environ["MSGLAB_SOURCE"]
    _report("source " + mine)
    others, deadline = [], _time.monotonic() + 20
    while not others and _time.monotonic() < deadline:
        others = [open(_os.path.join(_MARK, n)).read()[len("source "):] for n in _os.listdir(_MARK)
                  if not n.endswith(".part") and open(_os.path.join(_MARK, n)).read().startswith("source ")]
        others = sorted({o for o in others if o != mine})  # each of a run's processes reports its source
        _time.sleep(0.05)
    tried = {}
    for what, path in (("own", mine), *[("other", o) for o in others]):
        try:
            tried[what] = "read " + str(len(open(path).read()))
        except OSError as exc:
            tried[what] = "refused " + type(exc).__name__
    for what, folder in (("runs", _os.path.dirname(_os.path.dirname(_os.path.dirname(mine)))),
                         ("run", _os.path.dirname(_os.path.dirname(mine)))):
        try:
            tried[what] = "listed " + ",".join(_os.listdir(folder))
        except OSError as exc:
            tried[what] = "refused " + type(exc).__name__
    _report("tried " + _json.dumps({"others": len(others), **tried}))
_hostile(_snoop, once=True)
"""

# Lab 03: the shop's database replaced by a FIFO the moment the first payment is handled. The grader
# reads the ledger from that path at the end: opening a FIFO for reading waits for a writer forever.
FIFO_FOR_THE_DATABASE = """
def _swap(env):
    path = env.db_path
    try:
        _os.rename(path, path + ".old")
        _os.mkfifo(path)
        _report("swapped")
    except OSError as exc:
        _report(f"could not swap {type(exc).__name__}")
_hostile(_swap, once=True)
"""

# Run by a third user in no run's private /tmp, given both runs' source paths: what it can read or list.
OUTSIDE_PROBE = """
import json, os, sys
out = {}
def attempt(name, how):
    try:
        out[name] = how()
    except OSError as exc:
        out[name] = "refused " + type(exc).__name__
for source in sys.argv[1:]:
    run = os.path.dirname(os.path.dirname(source))
    attempt(source, lambda: "read " + str(len(open(source).read())))
    attempt(run, lambda: "listed " + ",".join(os.listdir(run)))
    attempt("runs", lambda: "listed " + ",".join(os.listdir(os.path.dirname(run))))
print(json.dumps(out))
"""

# The fault plan from the seed the learner typed (`msglab check 02 --seed 4242`): rebuild the grader's
# draws with the course's own nemesis code, read the plan key, and look for the seed on the command
# lines and environments of this process, its zygote and the nursery. SEED stands for the seed.
REBUILD_THE_PLAN = """
import json as _json


def _rebuild(env):
    from msglab.grading.nemesis import plan_key, rng
    seen = {"draws": [rng(SEED, s).random() for s in ("crash_order", "crash_calls", "final_order", "outage")]}
    try:
        plan_key()
        seen["key"] = "read"
    except OSError as exc:
        seen["key"] = "refused " + type(exc).__name__
    carried, pid = [], _os.getpid()
    for _ in range(3):  # this process, the run's zygote, the nursery
        for part in ("cmdline", "environ"):
            try:
                data = open(f"/proc/{pid}/{part}", "rb").read()
            except OSError:
                continue
            if b"SEED" in data:
                carried.append(f"{pid} {part}")
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    seen["carried"] = carried
    _report("plan " + _json.dumps(seen))
_hostile(_rebuild, once=True)
"""

# A sibling module that is a symlink to a file only the grader's user may read: the run copies the
# graded file's sibling modules, as the grader. Read it from the run's copy (and report what came).
READ_THROUGH_A_SIBLING = """
try:
    import grader_secret as _secret
    _report("outcome read " + repr(getattr(_secret, "SECRET", "")))
except ImportError as _exc:
    _report(f"outcome refused {type(_exc).__name__}")
"""
