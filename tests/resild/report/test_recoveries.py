"""resild.report.recoveries: the one recoveries analysis, on synthetic event logs."""

from __future__ import annotations

from typing import Any

import pytest

from resild.report.goodput import analyze, format_breakdown
from resild.report.recoveries import (
    BEFORE_START,
    NODE_FAILURE,
    NOT_RECOVERED,
    PHASES,
    RECOVERED,
    REFORM,
    SPARE_LOST,
    TRAINING_WENT_ON,
    recoveries,
)
from tests.launcher.run.test_status import (
    ev,
    fault_during_recovery,
    one_failure,
    replaced_before_start,
    shrunk_then_grown,
    spare_lost_and_no_spare_left,
    transient_reform,
)

pytestmark = pytest.mark.timeout(30)


def test_one_failure_every_instant() -> None:
    (r,) = recoveries(one_failure())
    assert (r.kind, r.node, r.fault, r.fault_time_from, r.outcome) == (
        NODE_FAILURE,
        "n1",
        "kill:n1@40",
        "injected",
        RECOVERED,
    )
    assert (r.t_fault, r.t_detected, r.t_fenced, r.t_decided, r.t_announced) == pytest.approx(
        (114.0, 114.1, 114.15, 114.16, 114.17)
    )
    assert (r.t_reformed, r.t_replayed, r.t_first_step) == pytest.approx((114.3, 114.55, 114.6))
    assert [r.phases[p] for p in PHASES] == pytest.approx([0.1, 0.05, 0.15, 0.25, 0.05])
    assert r.recovery_s == pytest.approx(0.6) and r.detect_s == pytest.approx(0.1)
    assert (r.epoch, r.spares_left, r.committed_step, r.resumed_step, r.steps_redone) == (2, 0, 40, 38, 2)
    assert (r.bytes_replayed, r.replay_s) == (1000, 0.15)
    assert r.stopped_training and not r.overlapped


def test_reform_is_a_recovery_from_the_collective_failure() -> None:
    (r,) = recoveries(transient_reform())
    assert (r.kind, r.node, r.rank, r.detector, r.fault_time_from) == (REFORM, None, 2, "probe", "collective failure")
    assert r.t_fenced is None and r.t_decided == pytest.approx(114.2) and r.t_announced == pytest.approx(114.21)
    assert r.recovery_s == pytest.approx(0.6) and r.resumed_step == 38
    assert r.steps_redone is None  # a reform event carries no committed step


def test_fault_during_recovery_counts_the_redone_steps_once() -> None:
    a, b = recoveries(fault_during_recovery())
    assert a.overlapped and not b.overlapped
    assert a.steps_redone is None and b.steps_redone == 2  # epoch 2 never resumed
    assert a.recovery_s == pytest.approx(115.0 - 114.0)  # fault -> full strength, after the second
    assert sum(a.phases.values()) == pytest.approx(0.4)  # cut at the second fault
    assert analyze(fault_during_recovery()).redone_s == pytest.approx(2 * 0.07)


def test_spare_lost_and_no_spare_left() -> None:
    a, b = recoveries(spare_lost_and_no_spare_left())
    assert (a.kind, a.outcome, a.phases, a.recovery_s) == (SPARE_LOST, TRAINING_WENT_ON, {}, None)
    assert (b.kind, b.outcome, b.recovery_s, b.epoch) == (NODE_FAILURE, NOT_RECOVERED, None, None)
    assert b.phases["detection"] == pytest.approx(0.1) and b.phases["fence"] == pytest.approx(0.05)


def test_before_start_is_start_up_not_recovery() -> None:
    (r,) = recoveries(replaced_before_start())
    assert (r.kind, r.outcome, r.phases, r.epoch) == (BEFORE_START, RECOVERED, {}, 1)
    assert r.recovery_s == pytest.approx(9.5) and not r.stopped_training
    b = analyze(replaced_before_start())
    assert b.recovery_s == 0 and b.startup_s == pytest.approx(10.0)
    assert sum(v for _, v in b.parts()) == pytest.approx(b.wall_s)
    text = format_breakdown(b)
    assert "recovery (0 failures)" in text and "replaced before training started" in text


def test_malformed_and_unknown_events_are_skipped() -> None:
    junk: list[Any] = [
        None,
        "x",
        {},
        {"event": "failure_detected"},
        {"event": "reform", "t_mono": "x"},
        {"event": "spare_assigned", "t_mono": 114.12, "failed": "n1", "epoch": "2"},  # numeric string: read
        {"event": "full_strength_step", "t_mono": 114.11, "epoch": None},
        {"event": "from_the_future", "t_mono": 114.13, "node": "n1"},
        {"event": "worker.loss", "t_mono": 114.14, "value": 1.0},
    ]
    clean = one_failure()
    (r,) = recoveries(clean[:6] + junk + clean[6:])
    (ref,) = recoveries(clean)
    assert r.recovery_s == pytest.approx(ref.recovery_s) and r.steps_redone == ref.steps_redone
    assert r.t_decided == pytest.approx(114.12)  # the first spare_assigned after detection, as before
    assert recoveries(junk) == [] and recoveries([]) == []


def test_two_faults_on_one_node_match_in_order() -> None:
    evs = one_failure()
    evs.insert(4, ev("fault_injected", 113.0, kind="hang", node="n1", step=30, spec="hang:n1@30"))
    (r,) = recoveries(evs)
    assert r.fault == "kill:n1@40"  # the latest injection before the detection


def test_a_shrink_is_the_recovery_of_a_failure_with_no_spare() -> None:
    (r,) = recoveries(shrunk_then_grown())  # the grow is no failure
    assert (r.kind, r.node, r.epoch, r.outcome, r.spares_left) == (NODE_FAILURE, "n1", 2, RECOVERED, 0)
    assert r.t_decided == pytest.approx(114.16) and r.resumed_step == 40 and r.steps_redone == 0
    assert r.recovery_s == pytest.approx(0.6)
