"""The classroom side of msglab: a learner edition, class grading, autograder platforms, a room server.

    edition.py     `msglab release`: the course without solutions/ (and without what needs them)
    points.py      a lab's checks and their points, from lab.toml; a verdict turned into a score
    submissions.py a class's submissions (folders or a platform's zip) -> one file per learner and lab
    gradebook.py   `msglab grade`: every learner's every lab graded in parallel; CSV, feedback, JSON
    gradescope.py  a Gradescope autograder: results.json, its setup.sh and run_autograder
    server.py      `msglab classroom serve`: one nats-server, one NATS account per learner
    join.py        `msglab join`: a learner's saved connection details (read by msglab.broker)
    status.py      `msglab classroom status`: learners, their streams, the labs they passed
    commands.py    `register(subparsers)`: the commands above, for msglab's CLI

Grading trusts the instructor's course, never the learner's copy of it: from a submission only the
file each lab's lab.toml names is read; lab.toml, the lab's other files and the graders come from
the course that grades (`course_root()`, MSGLAB_ROOT).
"""
