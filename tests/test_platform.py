"""The grading platform's own promises: the grader contract, the platform's hints, rule 6's allowance.

The rules' verdicts on real runs are tested through the variants (tests/variants/, test_variants.py);
here is what holds for every lab at once.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest

from msglab.catalog import Lab, all_labs, platform_hints
from msglab.grading import contract, rules
from msglab.grading.observe import Ack, BrokerWatch
from msglab.grading.rules import PLATFORM_CHECKS

LABS = all_labs()


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_every_grader_keeps_the_contract(lab: Lab) -> None:
    module = importlib.import_module(lab.grader_module)
    assert isinstance(module, contract.Grader)
    assert contract.problems(module) == []


def test_a_module_without_grade_or_roles_breaks_the_contract() -> None:
    empty = importlib.import_module("msglab.grading.rules")  # a module, but no grader
    found = contract.problems(empty)
    assert any("lacks grade(run) or playground(env)" in p for p in found)
    assert any("no role_<name> or ops_<name>" in p for p in found)


@pytest.mark.parametrize("lab", LABS, ids=[lab.number for lab in LABS])
def test_every_lab_has_the_platform_hints_unless_it_words_them_itself(lab: Lab) -> None:
    shared = platform_hints()
    assert set(PLATFORM_CHECKS) <= set(shared)
    for check in PLATFORM_CHECKS:
        assert check in lab.hints and check in lab.checks
        assert lab.hints[check].concept
    own = set(lab.hints) - set(shared)
    assert own, f"lab {lab.number} names no check of its own"


def test_a_lab_toml_table_replaces_the_platforms_words() -> None:
    lab02 = next(lab for lab in LABS if lab.number == "02")
    assert lab02.hints["survives_idle"] != platform_hints()["survives_idle"]
    assert "invoicing service" in lab02.hints["survives_idle"].code


def _watch(*acks: Ack) -> BrokerWatch:
    watch = BrokerWatch("S", "d")
    watch.acks.extend(acks)
    return watch


class _Did:
    """One recorded effect: who did it, when (what rules.allowance reads of an effect-log Event)."""

    def __init__(self, pid: int, ts: float) -> None:
        self.pid, self.ts = pid, ts


def test_a_duplicate_is_allowed_per_worker_that_ended_holding_the_delivery() -> None:
    # Worker 1 invoiced at t=1 and was killed at t=2, before any ack; worker 2 invoiced again and acked delivery 2.
    effects = [_Did(1, 1.0), _Did(2, 3.0)]
    allowance = rules.allowance({1: 2.0}, effects, _watch(Ack(3.1, "ack", 7, 2)), [7])
    assert (allowance.allowed, allowance.held, allowance.deliveries) == (2, [1], 2)


def test_no_duplicate_is_allowed_for_a_worker_that_ended_after_the_ack() -> None:
    effects = [_Did(1, 1.0), _Did(2, 3.0)]
    allowance = rules.allowance({1: 2.0}, effects, _watch(Ack(1.5, "ack", 7, 1)), [7])
    assert (allowance.allowed, allowance.held) == (1, [])


def test_the_allowance_never_exceeds_the_deliveries_the_broker_reported() -> None:
    # Two workers ended after doing it, but the broker reports one delivery only: one of them never
    # held a delivery of it (it repeated the effect from memory), so it earns no allowance.
    effects = [_Did(1, 1.0), _Did(2, 3.0), _Did(3, 5.0)]
    allowance = rules.allowance({1: 2.0, 2: 4.0}, effects, _watch(Ack(5.1, "ack", 7, 2)), [7])
    assert allowance.held == [1, 2]
    assert allowance.allowed == 2


def test_without_any_ack_the_allowance_counts_the_kills_only() -> None:
    effects = [_Did(1, 1.0), _Did(2, 3.0)]
    allowance = rules.allowance({1: 2.0, 2: 4.0}, effects, _watch(), [7])
    assert (allowance.allowed, allowance.deliveries) == (3, None)


def test_a_long_trace_keeps_its_start_and_its_end() -> None:
    lines = [f"step {n}" for n in range(30)]
    squashed = rules.squash(lines, keep=14)
    assert len(squashed) == 14
    assert squashed[:10] == lines[:10] and squashed[-3:] == lines[-3:]
    assert squashed[10] == "... 17 more steps ..."
    assert rules.squash(lines[:5]) == lines[:5]


def test_counts_read_as_words() -> None:
    assert rules.plural(1, "invoice") == "1 invoice" and rules.plural(3, "invoice") == "3 invoices"
    assert rules.an("ack") == "an ack" and rules.an("nak") == "a nak"


def test_a_planned_fault_that_is_not_a_crash_must_fire_too() -> None:
    refusal = rules.Planned("make the DLQ stream refuse your first dead letter", "publish it with JetStream")
    refusal.seen = "worker 7 published no dead letter"
    check = rules.faults_check([], [refusal])
    assert check.name == "faults_fired" and not check.passed
    assert "refuse your first dead letter, but worker 7 published no dead letter" in check.message
    assert check.hint == "publish it with JetStream"
    refusal.fired = True
    assert rules.faults_check([], [refusal]).passed


def test_two_durables_on_one_stream_are_two_topologies(server: Any) -> None:
    # A lab with two durables (lab 01: email and loyalty) provisions each; the second add_stream,
    # with the same configuration, is accepted by the server.
    import msglab
    from msglab.grading.labkit import Names
    from msglab.grading.scaffold import Topology

    email = Topology("PLATFORM_T", "t.>", "email", "t.placed", 0.4)
    loyalty = Topology("PLATFORM_T", "t.>", "loyalty", "t.placed", 0.4)

    async def body() -> list[str]:
        nc, js = await msglab.connect(server.url)
        try:
            for topology in (email, loyalty):
                await topology.provision(js, Names())
            names = await js.consumers_info("PLATFORM_T")
            await js.delete_stream("PLATFORM_T")
            return sorted(c.name for c in names)
        finally:
            await nc.close()

    assert asyncio.run(body()) == ["email", "loyalty"]
