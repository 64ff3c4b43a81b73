"""The grading platform: one run of one lab, from seed to verdict.

    grade.py    pick the file, draw or take the seed, run the lab's grader, return a Verdict
    harness.py  Run: a fresh broker, learner processes, the effect channel, the shared checks
    runner.py   the learner's child process (`python -m msglab.grading.runner`)
    nemesis.py  seeded crash plans, kept by the grader and fired by it
    effects.py  the effect log (in the grader's memory) and the course's SQLite opener
    observe.py  what the grader sees on the broker itself: acks, pull requests, refused publishes
    verdict.py  checks with evidence and hints, rendered as text, JSON and HTML
    labkit.py   `env`, what learner code is handed, and the platform's stream and durable
    rules.py    the rules below, each written once (faults, deaths, survives_idle, rule 6's allowance,
                drained) and the wording every verdict shares; hints.toml holds their hints
    scaffold.py what a workload is built from: Topology, HeldSpawns, Phases, Trace
    contract.py what a grader module defines (the Grader Protocol), checked over the catalogue
    example.py  the example lab's grader (examples/00_echo; docs/authoring.md walks through it)

The trust boundary, in words:

    grader process (trusted)                     learner processes (untrusted: the file and
      seed, fault plan, effect log, verdict        everything it starts)
      its own NATS connection: sees acks   <--- NATS (the lab's subjects, its durable) --->
      and pull requests on the broker                env.nc / env.js
      answers effects; SIGKILLs at the     <--- effect socket: "call send_email o-3" ----
      planned call, before or after                  env.send_email(...) blocks for the answer
      course services (gateway, ...) in    <--- NATS request-reply ---------------------->
      processes of their own

What is judged (effects, crashes, acks, timings) is recorded by the grader or a course service
with the grader's clock; the learner's process can request an effect (that is doing it) but
never write a record. The fault plan never leaves the grader, so faults cannot be switched off
from inside; the grader fires them itself and knows which fired.

Rules every grader follows (modules 04-08 copy them):

1. A planned fault that did not fire invalidates the run: `rules.faults_check` fails any run in
   which a planned crash did not happen, saying what the code did instead, in the lab's words
   (the labels on the Crash).
2. Workers are long-running: after the backlog drains and an idle gap longer than the worker's
   own fetch timeout (seen on the broker: `BrokerWatch.refetched_after_idle`), a late message
   must be handled by the worker already running. A worker that returns fails (`rules.survives_idle`,
   check id `survives_idle` in every lab).
3. An unplanned death is a failure: a learner process that raises or exits (not a kill the
   nemesis or the grader made) fails `rules.deaths_check`, which quotes the traceback, also on an
   otherwise passing run. `grade.py` appends rules 1 and 3 to every verdict.
4. Claims are checked on the broker: "accepted" means the stream confirmed it. Graders make the
   stream refuse a publish at a seeded moment (`refuse_publishes`); an order reported accepted
   must be in the stream.
5. No luck in timing: redeliveries and duplicates are spread over more than a second, so keys
   made from the clock or the attempt fail; a required request timeout differs from the client
   library's default (nats-py: 0.5 s), so a missing timeout fails.
6. Allowances come from what happened: a duplicate effect is allowed exactly where the evidence
   shows a delivery held by a worker that was killed before its ack (acks as the broker saw
   them), whichever way the learner batches or orders its work; never more often than the broker
   redelivered it (`rules.allowance`).
7. Messages only claim what the evidence shows, and the hint targets the actual cause.
8. Load does not change a verdict: the same file and seed give the same verdict on an idle
   machine and on a busy one (tests/test_variants_under_load.py). Bounds are on what happened,
   or are lower bounds that load cannot break; upper bounds are generous deadlines.
9. Every rule has wrong variants (tests/variants/NN_x/*.py, each naming the check it must fail)
   and correct alternatives written differently (tests/variants/NN_x/also_right/), graded over
   at least 5 seeds in the test suite (four of each file's own, one with every core busy; a deep
   run grades them all, a quick `make test` one seed a file, another each commit).

The lab pattern (modules 04-08 copy it):

- `labs/NN_x/`: the learner's file (TODOs state requirements, never the call to write), README.md
  (the task as requirements, what the grader does, counts that match the grader), lab.ipynb, and
  lab.toml with hints in levels. Level 1 of every hint is the verdict itself (invariant, evidence,
  the hint that fits the cause); levels 2 and 3 open with `msglab hint NN` once the same check
  failed again:

      [hints.no_lost_emails]     # one table per check id the grader can fail
      concept = "..."            # level 2: the idea in two or three sentences, no code
      lesson = "section 3, 'Kill the worker'"   # level 2: where a lesson cell shows it
      code = "..."               # level 3: concrete, code-level

  The platform's checks (faults_fired, no_unplanned_deaths, survives_idle, file_imports,
  finishes) have their hints once, in msglab/grading/hints.toml; a lab.toml table of the same id
  replaces them only where the lab needs its own words.

- `tests/variants/NN_x/*.py`: wrong variants, whole learner files whose docstring has a line
  `Expect: fail <check_id>[, <check_id>]`; `tests/variants/NN_x/also_right/*.py`: correct ones
  written differently, `Expect: pass`. tests/test_variants.py grades all of them, the starter
  (must fail) and the solution (must pass) on each file's own seeds, idle and under CPU load (rule 9).

A grader error (its own bug, a server that will not start) is a GraderError: exit code 2 with a
message saying it is the course's fault, never a learner FAIL.
"""
