"""Lesson plumbing, one module per lesson, named like its grader: `demos/<topic>.py` serves
`lessons/NN_<topic>.ipynb` (experiments, worker processes, counters). Lessons call it in one line.
"""
