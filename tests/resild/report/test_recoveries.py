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
    wev,
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


def shrunk_without_a_fault() -> list[dict[str, Any]]:
    """Nothing injected: n1's worker dies, no spare, the job shrinks to n0 alone in epoch 2."""
    return [
        ev("job_started", 100.0, nodes=["n0", "n1"]),
        ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3]}),
        ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
        ev("failure_detected", 114.1, node="n1", cause="worker died", detector="process-exit", committed_step=40),
        ev("node_fenced", 114.15, node="n1", reason="worker died"),
        ev("job_resized", 114.16, how="shrink", node="n1", epoch=2, world_size=2, was=4, full=4, spares_left=0),
        ev("membership", 114.17, epoch=2, layout={"n0": [0, 1]}),
        wev("group_reformed", 114.4, node="n0", rank=0, epoch=2, seconds=0.1, world_size=2),
        wev("resumed", 114.5, node="n0", rank=0, epoch=2, step=39, seconds=0.3),  # formed at 114.3
        ev("full_strength_step", 114.6, epoch=2, step=40, rank=0),
    ]


def test_a_shrink_every_instant() -> None:
    (r,) = recoveries(shrunk_without_a_fault())
    assert (r.kind, r.node, r.epoch, r.outcome, r.fault, r.fault_time_from) == (
        NODE_FAILURE,
        "n1",
        2,
        RECOVERED,
        None,
        "detection",
    )
    assert (r.t_detected, r.t_fenced, r.t_decided, r.t_announced) == pytest.approx((114.1, 114.15, 114.16, 114.17))
    assert (r.t_reformed, r.t_replayed, r.t_first_step) == pytest.approx((114.3, 114.5, 114.6))
    assert (r.spares_left, r.committed_step, r.resumed_step, r.steps_redone) == (0, 40, 39, 1)
    # no fault time: detection 0; fence .05, re-form →114.3 .15, replay →resumed .2, first step .1
    assert [r.phases[p] for p in PHASES] == pytest.approx([0.0, 0.05, 0.15, 0.2, 0.1])
    assert r.recovery_s == pytest.approx(0.5) and r.stopped_training and r.bytes_replayed == 0


def test_a_shrink_that_never_reached_full_strength_did_not_recover() -> None:
    evs = [e for e in shrunk_without_a_fault() if not (e["event"] == "full_strength_step" and e["epoch"] == 2)]
    (r,) = recoveries(evs)
    assert (r.epoch, r.outcome, r.recovery_s, r.t_first_step) == (2, NOT_RECOVERED, None, None)
    assert r.t_decided == pytest.approx(114.16) and r.resumed_step is None


def lost_spare_back_and_grown(again: bool = False) -> list[dict[str, Any]]:
    """Spare s0's worker dies (no epoch: training went on); n1 dies, the job shrinks (epoch 2);
    s0 comes back and grows the job (epoch 3). `again`: s0, in the job now, dies again and
    the job shrinks (epoch 4)."""
    evs = shrunk_without_a_fault()
    evs[3:3] = [
        ev("failure_detected", 112.0, node="s0", cause="worker died", detector="process-exit", committed_step=30),
        ev("node_fenced", 112.01, node="s0", reason="worker died"),
    ]
    evs += [
        ev("node_readmitted", 116.0, node="s0", reason="fenced without evidence", spares=1),
        ev("job_resized", 117.0, how="grow", node="s0", epoch=3, world_size=4, was=2, full=4, spares_left=0),
        ev("membership", 117.01, epoch=3, layout={"n0": [0, 1], "s0": [2, 3]}),
        ev("full_strength_step", 117.5, epoch=3, step=60, rank=0),
    ]
    if again:
        evs += [
            ev("failure_detected", 118.0, node="s0", cause="worker died", detector="process-exit", committed_step=70),
            ev("node_fenced", 118.05, node="s0", reason="worker died"),
            ev("job_resized", 118.06, how="shrink", node="s0", epoch=4, world_size=2, was=4, full=4, spares_left=0),
            ev("membership", 118.07, epoch=4, layout={"n0": [0, 1]}),
            wev("resumed", 118.3, node="n0", rank=0, epoch=4, step=70, seconds=0.2),
            ev("full_strength_step", 118.4, epoch=4, step=71, rank=0),
        ]
    return evs


def test_a_failure_takes_its_own_nodes_shrink_and_a_grow_is_no_failure() -> None:
    # Neither n1's shrink nor s0's own grow later is the decision of s0's failure.
    lost, shrunk = recoveries(lost_spare_back_and_grown())
    assert (lost.kind, lost.node, lost.outcome) == (SPARE_LOST, "s0", TRAINING_WENT_ON)
    assert (lost.epoch, lost.spares_left, lost.t_decided) == (None, None, None)
    assert (shrunk.kind, shrunk.node, shrunk.epoch, shrunk.outcome) == (NODE_FAILURE, "n1", 2, RECOVERED)
    assert shrunk.t_decided == pytest.approx(114.16) and shrunk.resumed_step == 39 and not shrunk.overlapped


def test_a_node_back_in_the_job_shrinks_it_again_in_its_own_recovery() -> None:
    *_, again = recoveries(lost_spare_back_and_grown(again=True))
    assert (again.kind, again.node, again.epoch, again.outcome) == (NODE_FAILURE, "s0", 4, RECOVERED)
    assert again.t_decided == pytest.approx(118.06) and again.resumed_step == 70 and again.steps_redone == 0
    assert again.recovery_s == pytest.approx(0.4)


def test_a_spare_lost_twice_keeps_no_epoch_for_its_first_loss() -> None:
    """A failure's decision comes before the same node's next failure (it was taken from
    anywhere after: the second loss lent the first its epoch)."""
    lost, _, _ = recoveries(lost_spare_back_and_grown(again=True))
    assert (lost.epoch, lost.spares_left, lost.t_decided) == (None, None, None)
