"""Which joining nodes become a running job's spares (resild.controller.admission)."""

from __future__ import annotations

import pytest

from resild.controller.admission import MAX_JOIN, MAX_PENDING, admission
from resild.controller.view import ClusterView, NodeView
from resild.membership import NodeRole


def _view() -> ClusterView:
    return ClusterView(
        {
            "a": NodeView("a", NodeRole.ACTIVE, 1),
            "s": NodeView("s", NodeRole.SPARE, 1),
            "f": NodeView("f", NodeRole.FENCED, 1),
        }
    )


def test_new_names_of_the_right_job_are_admitted_with_a_reason() -> None:
    a = admission(_view(), "job1", "job1", ["n1", "n2"], over=False)
    assert a.admit and a.nodes == ("n1", "n2") and "n1, n2 joined job job1" in a.reason


def test_spares_admitted_that_never_register_are_bounded() -> None:
    view = _view()
    view.nodes["s"].registered = True
    for i in range(MAX_PENDING):
        view.add(NodeView(f"p{i}", NodeRole.SPARE, 1), 0.0)  # admitted, never registered
    a = admission(view, "job1", "job1", ["n1"], over=False)
    assert not a.admit and f"{MAX_PENDING} spares admitted earlier have not registered yet" in a.reason
    view.nodes["p0"].registered = True
    assert admission(view, "job1", "job1", ["n1"], over=False).admit


@pytest.mark.parametrize(
    ("job_id", "asked", "names", "over", "keyed", "why"),
    [
        ("job1", "job1", ["n1"], False, False, "without keys"),
        ("", "", ["n1"], False, True, "takes no joining nodes"),
        ("job1", "job0", ["n1"], False, True, "runs job job1, not 'job0'"),
        ("job1", "job1", ["n1"], True, True, "is ending"),
        ("job1", "job1", [], False, True, "no node named"),
        ("job1", "job1", ["n1", "n1"], False, True, "named twice"),
        ("job1", "job1", ["bad name"], False, True, "cannot name a node"),
        ("job1", "job1", ["join"], False, True, "cannot name a node"),  # the join key's own identity
        ("job1", "job1", ["s"], False, True, "already a node of job job1 (spare)"),
        ("job1", "job1", ["f"], False, True, "already a node of job job1 (fenced)"),  # never back under its name
        ("job1", "job1", [f"n{i}" for i in range(MAX_JOIN + 1)], False, True, "at most"),
    ],
)
def test_a_refusal_says_why_and_admits_no_one(job_id, asked, names, over, keyed, why) -> None:
    a = admission(_view(), job_id, asked, names, over=over, keyed=keyed)
    assert not a.admit and a.nodes == () and why in a.reason
