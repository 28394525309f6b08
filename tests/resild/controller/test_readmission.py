"""Which nodes fenced on suspicion come back as spares (resild.controller.readmission)."""

from __future__ import annotations

from resild.controller.readmission import readmission
from resild.controller.view import ClusterView, NodeView
from resild.membership import Membership, NodeRole

QUIET_S = 6.0


def _view(fenced_at: float = 100.0) -> ClusterView:
    v = ClusterView(
        {
            "a": NodeView("a", NodeRole.ACTIVE, 1),
            "b": NodeView("b", NodeRole.ACTIVE, 1),
            "x": NodeView("x", NodeRole.FENCED, 1, reason="worker 0 raised"),
        }
    )
    v.membership = Membership.initial(["a", "b"], 1)
    v.strikes["x"] = [fenced_at]  # fenced without evidence: a suspect
    return v


def test_a_suspect_whose_old_processes_are_gone_and_quiet_comes_back() -> None:
    r = readmission(106.0, _view(), frozenset({"x"}), QUIET_S)
    assert r is not None and r.node == "x"
    assert "fenced without evidence" in r.reason and "worker 0 raised" in r.reason


def test_nothing_comes_back_too_early_or_while_its_old_incarnation_still_speaks() -> None:
    assert readmission(105.9, _view(), frozenset({"x"}), QUIET_S) is None
    v = _view()
    v.nodes["x"].fenced_heard_s = 103.0  # a stopped process that woke and spoke: fenced again
    assert readmission(108.0, v, frozenset({"x"}), QUIET_S) is None
    assert readmission(109.0, v, frozenset({"x"}), QUIET_S) is not None


def test_evidence_a_second_strike_or_no_way_to_restart_keeps_a_node_out() -> None:
    v = _view()
    v.drained.add("x")  # evidence against it, or its second strike: drained
    assert readmission(200.0, v, frozenset({"x"}), QUIET_S) is None
    v = _view()
    del v.strikes["x"]  # fenced with evidence (never a suspect)
    assert readmission(200.0, v, frozenset({"x"}), QUIET_S) is None
    assert readmission(200.0, _view(), frozenset(), QUIET_S) is None  # its old process may still run
    v = _view()
    v.membership = None  # start-up: a lost node is replaced, not waited for
    assert readmission(200.0, v, frozenset({"x"}), QUIET_S) is None
    v = _view()
    v.nodes["x"].role = NodeRole.SPARE  # back already
    assert readmission(200.0, v, frozenset({"x"}), QUIET_S) is None
