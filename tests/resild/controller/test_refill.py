"""How many cold spares the job asks the queue for (resild.controller.refill)."""

from __future__ import annotations

from resild.controller.refill import MAX_REQUEST, refill
from resild.controller.view import ClusterView, NodeView
from resild.membership import Membership, NodeRole


def _view(spares: int) -> ClusterView:
    nodes = {n: NodeView(n, NodeRole.ACTIVE, 1) for n in ("a", "b")}
    nodes.update({f"s{i}": NodeView(f"s{i}", NodeRole.SPARE, 1) for i in range(spares)})
    v = ClusterView(nodes)
    v.membership = Membership.initial(["a", "b"], 1)
    return v


def test_the_gap_to_the_target_is_asked_for_once() -> None:
    r = refill(_view(0), target=2, on_the_way=0)
    assert r.count == 2 and "below the target of 2: asking for 2" in r.reason
    assert refill(_view(0), 2, on_the_way=2).count == 0  # asked already: not twice for one gap
    assert refill(_view(1), 2, on_the_way=0).count == 1
    assert refill(_view(3), 2, on_the_way=0).count == 0  # a surplus is not cancelled mid-job


def test_no_target_no_start_and_a_burst_is_bounded() -> None:
    assert refill(_view(0), 0, 0).count == 0
    v = _view(0)
    v.membership = None
    assert refill(v, 2, 0).count == 0  # start-up: the job's own spares are still registering
    assert refill(_view(0), 100, 0).count == MAX_REQUEST
