"""Course services that lessons and graders both use (the payment gateway, later more).

Each runs outside the learner's code, keeps its own store and is reached over NATS, so what it
records is evidence the learner's process cannot rewrite.
"""
