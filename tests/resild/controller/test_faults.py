from __future__ import annotations

import pytest

from resild.controller.faults import Fault, FaultSpecError, Injector, parse_fault


@pytest.mark.parametrize(
    "spec,expect",
    [
        ("kill:node1@40", Fault("kill", "node1", 40)),
        ("xid79:node2@120", Fault("xid79", "node2", 120)),
        ("hang:local-node0@200+0.5", Fault("hang", "local-node0", 200, 0.5)),
        ("kill:node2@e2", Fault("kill", "node2", 0, epoch=2)),
    ],
)
def test_parse(spec: str, expect: Fault) -> None:
    assert parse_fault(spec) == expect


@pytest.mark.parametrize("spec", ["kill:node1", "boom:node1@3", "kill@3", "kill:node1@-1", ""])
def test_parse_rejects_with_an_example(spec: str) -> None:
    with pytest.raises(FaultSpecError, match="kill:node1@40|unknown fault kind"):
        parse_fault(spec)


def test_xid_number() -> None:
    assert parse_fault("xid48:n@1").xid == 48 and parse_fault("kill:n@1").xid is None


def test_injector_fires_once_after_step_and_delay() -> None:
    inj = Injector([Fault("kill", "a", 10), Fault("hang", "b", 10, delay_s=1.0)])
    assert inj.due(9, now=0.0) == []
    assert [f.kind for f in inj.due(10, now=5.0)] == ["kill"]
    assert inj.due(11, now=5.5) == []
    assert [f.kind for f in inj.due(12, now=6.0)] == ["hang"]
    assert inj.due(13, now=9.0) == []


def test_epoch_trigger_fires_when_the_epoch_is_announced() -> None:
    inj = Injector([Fault("kill", "s", 0, epoch=2)])
    assert inj.due(50, now=0.0, epoch=1) == []
    assert [f.node for f in inj.due(50, now=0.0, epoch=2)] == ["s"]


def test_step_faults_wait_for_full_strength_and_fire_apart_when_several_are_due() -> None:
    # A leader away for a while (or a long recovery) must not fire a schedule's faults all
    # together: the soak lost a job when two faults meant 24 steps apart hit both nodes at once.
    inj = Injector([Fault("exception", "a", 125), Fault("kill", "b", 149), Fault("hang", "c", 149)])
    assert inj.due(178, now=0.0, busy=True) == []  # a takeover or recovery under way
    assert [f.node for f in inj.due(178, now=0.1)] == ["a"]  # the earliest step only
    assert [f.node for f in inj.due(180, now=0.2)] == ["b", "c"]  # one step's faults together
    assert inj.due(200, now=0.3) == []


def test_an_epoch_fault_fires_during_a_recovery() -> None:
    inj = Injector([Fault("kill", "s", 0, epoch=2)])
    assert [f.node for f in inj.due(5, now=0.0, epoch=2, busy=True)] == ["s"]


def test_a_fired_fault_holds_the_next_until_its_recovery_is_announced() -> None:
    # Soak schedule #14: after a takeover a second fault fired 16 ms after the first,
    # before the first was detected, and both copies of a state were lost.
    inj = Injector([Fault("kill", "a", 10), Fault("kill", "b", 12), Fault("kill", "c", 14)], settle_s=20.0)
    (first,) = inj.due(12, now=0.0)
    inj.fired(first, now=0.0)
    assert inj.due(12, now=0.016) == []  # detected or not, nobody has recovered yet
    inj.settled()  # the recovery's epoch went out
    (second,) = inj.due(12, now=1.0)
    assert second.node == "b"
    inj.fired(second, now=1.0)
    assert inj.due(14, now=20.9) == []
    assert [f.node for f in inj.due(14, now=21.0)] == ["c"]  # a fault nobody detected holds back settle_s


def test_a_corrupt_fault_holds_nothing_back() -> None:
    inj = Injector([Fault("corrupt", "a", 10), Fault("kill", "b", 11)])
    (c,) = inj.due(11, now=0.0)
    inj.fired(c, now=0.0)
    assert [f.node for f in inj.due(11, now=0.1)] == ["b"]


def test_a_slow_fault_carries_its_slowdown_and_only_a_slow_fault_may() -> None:
    from resild.controller.faults import FaultSpecError, parse_fault

    f = parse_fault("slow:node1@20+300%")
    assert (f.kind, f.step, f.pct, f.delay_s) == ("slow", 20, 300, 0.0) and str(f) == "slow:node1@20+300%"
    assert parse_fault("slow:node1@20").pct == 0  # the worker's default (50%)
    for bad in ("kill:node1@20+30%", "slow:node1@20+1001%"):
        try:
            parse_fault(bad)
        except FaultSpecError as e:
            assert "slow fault" in str(e)
        else:
            raise AssertionError(bad)
