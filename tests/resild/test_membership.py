"""Membership deltas and the O(1) indexes: pure, no sockets."""

from __future__ import annotations

import pytest

from resild.controller.view import ClusterView, NodeView
from resild.membership import DeltaMismatch, Membership, NodeRole

pytestmark = pytest.mark.timeout(30)


def layout(n: int = 4, p: int = 2) -> Membership:
    return Membership.initial([f"n{i}" for i in range(n)], p)


def test_delta_of_a_replacement_is_one_move_and_applies_to_the_same_layout() -> None:
    m1 = layout()
    m2 = m1.replace("n2", "s0")
    d = m2.delta_from(m1)
    assert d == {"epoch": 2, "base": 1, "world_size": 8, "moves": {"n2": "s0"}, "committed": 0}
    assert m1.apply_delta(d) == m2
    assert list(m1.apply_delta(d).node_ranks) == list(m2.node_ranks)  # node order kept too


def test_delta_of_a_reform_is_empty() -> None:
    m1 = layout()
    d = m1.bump().delta_from(m1)
    assert d is not None and d["moves"] == {} and m1.apply_delta(d) == m1.bump()


def test_deltas_chain_over_several_epochs() -> None:
    m = layout(6, 3)
    held = m
    for failed, spare in (("n1", "s0"), ("n4", "s1"), ("s0", "s2")):
        new = m.replace(failed, spare)
        held = held.apply_delta(new.delta_from(m))
        m = new
    assert held == m and m.node_ranks["s2"] == (3, 4, 5)


def test_a_delta_against_another_epoch_is_refused() -> None:
    m1 = layout()
    m2 = m1.replace("n0", "s0")
    m3 = m2.replace("n1", "s1")
    with pytest.raises(DeltaMismatch):
        m1.apply_delta(m3.delta_from(m2))  # the holder missed epoch 2: it needs the full layout
    with pytest.raises(DeltaMismatch):
        m3.apply_delta(m3.delta_from(m2))  # old news


def test_a_delta_naming_unknown_or_merging_nodes_is_refused() -> None:
    m1 = layout()
    with pytest.raises(DeltaMismatch):
        m1.apply_delta({"epoch": 2, "base": 1, "world_size": 8, "moves": {"zz": "s0"}})
    with pytest.raises(DeltaMismatch):
        m1.apply_delta({"epoch": 2, "base": 1, "world_size": 8, "moves": {"n0": "n1"}})
    with pytest.raises(DeltaMismatch):
        m1.apply_delta({"epoch": 2, "base": 1, "world_size": 9, "moves": {}})


def test_a_swap_is_sent_as_a_full_layout_but_a_hand_made_swap_delta_applies() -> None:
    m1 = layout(2, 2)
    m2 = Membership(2, 4, {"n1": (0, 1), "n0": (2, 3)})
    assert m2.delta_from(m1) is None  # nodes that stay but change ranks: not a renaming
    assert m1.apply_delta({"epoch": 2, "base": 1, "world_size": 4, "moves": {"n0": "n1", "n1": "n0"}}) == m2


def test_no_delta_when_the_layout_is_not_a_renaming() -> None:
    m1 = layout(2, 2)
    assert Membership(2, 4, {"n0": (0, 2), "n1": (1, 3)}).delta_from(m1) is None
    assert Membership(2, 6, {"n0": (0, 1, 2), "n1": (3, 4, 5)}).delta_from(m1) is None
    assert Membership(2, 4, {"n0": (0, 1, 2, 3)}).delta_from(m1) is None


def test_node_of_is_indexed_and_follows_the_epoch() -> None:
    m1 = layout(2000, 8)
    assert m1.node_of(15_999) == "n1999" and m1.node_of(16_000) is None
    m2 = m1.replace("n1999", "s0")
    assert m2.node_of(15_999) == "s0" and m1.node_of(15_999) == "n1999"


def test_a_node_view_names_its_ranks_and_follows_deltas() -> None:
    m1 = layout(4, 2)
    v = m1.view("n1")
    assert v.partial and not m1.partial
    assert v.node_ranks == {"n1": (2, 3)} and v.world_size == 8 and v.rank_of("n1", 1) == 3
    assert Membership.from_dict(v.to_dict()) == v
    m2 = m1.replace("n3", "s0")
    assert v.apply_delta(m2.delta_from(m1)) == m2.view("n1")  # others' moves: just the epoch
    assert m1.view("n3").apply_delta(m2.delta_from(m1)) == m2.view("s0")  # (never sent: n3 is fenced)
    assert m1.view("zz").node_ranks == {} and m1.view("zz").rank_of("zz", 0) is None
    with pytest.raises(DeltaMismatch):
        v.apply_delta(m2.replace("n0", "s1").delta_from(m2))  # missed epoch 2


def test_full_layout_round_trips() -> None:
    m = layout(3, 4).replace("n1", "s")
    assert Membership.from_dict(m.to_dict()) == m


def test_the_committed_floor_travels_in_views_deltas_and_layouts() -> None:
    m1 = layout(4, 2).with_committed(3)
    m2 = m1.replace("n3", "s0").with_committed(41)
    assert m2.committed == 41 and m2.view("n0").committed == 41 and m2.bump().committed == 41
    assert Membership.from_dict(m2.to_dict()) == m2 and m2.to_dict()["committed"] == 41
    d = m2.delta_from(m1)
    assert d is not None and d["committed"] == 41
    assert m1.apply_delta(d).committed == 41 and m1.view("n1").apply_delta(d) == m2.view("n1")
    assert m1 != layout(4, 2)  # the floor is part of the epoch: a different floor is another membership
    old = {k: v for k, v in m1.to_dict().items() if k != "committed"}  # a journal from before the floor
    assert Membership.from_dict(old).committed == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7", 1 << 53])
def test_a_committed_floor_that_is_not_a_step_is_refused(bad: object) -> None:
    m1 = layout(2, 1)
    with pytest.raises(ValueError, match="committed"):
        Membership.from_dict({**m1.to_dict(), "committed": bad})
    with pytest.raises(ValueError, match="committed"):
        m1.apply_delta({"epoch": 2, "base": 1, "world_size": 2, "moves": {}, "committed": bad})


def test_the_delta_of_an_epoch_made_by_replace_is_the_one_computed_from_the_layouts() -> None:
    m1 = layout(50, 4)
    for m2 in (m1.replace("n7", "s0").with_committed(9), m1.bump()):
        fresh = Membership.from_dict(m2.to_dict())  # knows nothing of how it was made: O(nodes)
        assert m2.delta_from(m1) == fresh.delta_from(m1) is not None
    # From another layout of the same epoch (n0 and n1 swapped): computed, never assumed.
    other = Membership(1, 200, {**m1.node_ranks, "n0": m1.node_ranks["n1"], "n1": m1.node_ranks["n0"]})
    assert m1.replace("n7", "s0").delta_from(other) is None


def test_heartbeat_order_puts_the_longest_silent_node_first() -> None:
    nodes = {n: NodeView(n, NodeRole.ACTIVE, 1, registered=True, last_heartbeat_s=10.0) for n in "abc"}
    v = ClusterView(nodes)
    v.beat("a", 11.0)
    v.beat("b", 12.0)
    assert [n.node_id for n in v.by_heartbeat()] == ["c", "a", "b"]
    v.beat("c", 13.0)
    assert [n.node_id for n in v.by_heartbeat()] == ["a", "b", "c"]
    v.beat("b", 5.0)  # a clock going back (tests only) still leaves the order right
    assert [n.node_id for n in v.by_heartbeat()] == ["b", "a", "c"]


def test_shrink_drops_the_failed_node_and_renumbers_the_survivors_in_order() -> None:
    m = Membership.initial(["a", "b", "c"], 2)
    s = m.shrink("a")
    assert (s.epoch, s.world_size) == (2, 4)
    assert s.node_ranks == {"b": (0, 1), "c": (2, 3)}
    assert s.shrink("c").node_ranks == {"b": (0, 1)}
    # the delta protocol cannot express a resize: the full layout goes out
    assert s.delta_from(m) is None


def test_grow_appends_the_spare_s_ranks_after_the_last_one() -> None:
    m = Membership.initial(["a", "b", "c"], 2).shrink("b")
    g = m.grow("s", 2)
    assert (g.epoch, g.world_size) == (3, 6)
    assert g.node_ranks == {"a": (0, 1), "c": (2, 3), "s": (4, 5)}
    assert g.rank_of("s", 1) == 5
    with pytest.raises(ValueError):
        g.grow("a", 2)
    with pytest.raises(KeyError):
        g.shrink("zz")
