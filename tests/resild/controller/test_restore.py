"""A controller taking over from a journal (a standby's replicated copy): what it
rebuilds, and how peers follow a new leader."""

from __future__ import annotations

import json
from typing import Any

import zmq

from resild.controller.faults import parse_fault
from resild.controller.loop import Controller, ControllerConfig
from resild.controller.policy import Action, Decision
from resild.controller.records import Admit, Grow, ReplicaUnit, Shrink, Start, decided, parse_record
from resild.controller.restore import Restored, apply, fold
from resild.events.log import EventLog
from resild.membership import Membership, NodeRole
from resild.wire.channel import Channel, connect, peer_name
from resild.wire.leader import ControllerSet
from resild.wire.protocol import Message, MsgType


def _controller(faults: list[str] = ()) -> Controller:
    return Controller(
        ControllerConfig(), ["a", "b"], ["s0", "s1"], 2, None, EventLog(), faults=[parse_fault(f) for f in faults]
    )


def test_restore_rebuilds_roles_epoch_floor_and_fired_faults() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0")
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "fault_fired", "spec": "kill:b@10"},
        {
            "action": "replace_node",
            "node": "b",
            "spare": "s0",
            "membership": m2.to_dict(),
            "committed_step": 12,
            "reason": "b failed",
        },
        {"action": "leader", "index": 1},  # unknown to restore: ignored
    ]
    ctl = _controller(["kill:b@10", "kill:a@50"])
    try:
        ctl.restore(records, now=100.0)
        v = ctl.view
        assert v.membership == m2.with_committed(12)  # the epoch's floor: its decision's committed step
        assert {n: x.role for n, x in v.nodes.items()} == {
            "a": NodeRole.ACTIVE,
            "b": NodeRole.FENCED,
            "s0": NodeRole.ACTIVE,
            "s1": NodeRole.SPARE,
        }
        assert ctl.max_step == 12 and ctl.result is None
        assert [str(f) for f in ctl.injector.pending] == ["kill:a@50"]  # fired once, ever
        assert not ctl.injector.unsettled(100.0)  # kill:b@10 was handled: its epoch is in the journal
        # Every node still in the job is expected to speak within the heartbeat timeout.
        assert all(v.nodes[n].registered and v.nodes[n].last_heartbeat_s == 100.0 for n in ("a", "s0", "s1"))
        assert ctl.node_ident == {}  # routing ids are random: learnt from the heartbeats
    finally:
        ctl.server.close()


def test_a_new_leader_keeps_the_nodes_that_joined_and_what_became_of_them() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0")
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "admit", "nodes": ["j0", "j1"], "reason": "j0, j1 joined"},
        {"action": "admit", "nodes": ["j0"], "reason": "a replayed record admits no one twice"},
        {"action": "replace_node", "node": "b", "spare": "j0", "membership": m2.replace("s0", "j0").to_dict()},
    ]
    ctl = _controller()
    try:
        ctl.restore(records, now=50.0)
        roles = {n: x.role for n, x in ctl.view.nodes.items()}
        assert roles == {
            "a": NodeRole.ACTIVE,
            "b": NodeRole.FENCED,
            "s0": NodeRole.SPARE,
            "s1": NodeRole.SPARE,
            "j0": NodeRole.ACTIVE,
            "j1": NodeRole.SPARE,
        }
        j1 = ctl.view.nodes["j1"]
        assert j1.nproc == 2 and j1.registered and j1.last_heartbeat_s == 50.0  # silent from now on: lost
    finally:
        ctl.server.close()


def test_a_new_leader_keeps_a_node_that_came_back_after_a_suspect_fence() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "replace_node", "node": "b", "spare": "s0", "membership": m1.replace("b", "s0").to_dict()},
        {"action": "readmit", "node": "b", "reason": "b was fenced without evidence"},
        {"action": "readmit", "node": "a", "reason": "a live node is not fenced: nothing to bring back"},
    ]
    ctl = _controller()
    try:
        ctl.restore(records, now=10.0)
        roles = {n: x.role for n, x in ctl.view.nodes.items()}
        assert roles == {"a": NodeRole.ACTIVE, "b": NodeRole.SPARE, "s0": NodeRole.ACTIVE, "s1": NodeRole.SPARE}
        assert ctl.view.nodes["b"].reason == ""
    finally:
        ctl.server.close()


def test_a_fault_the_old_leader_fired_last_is_fired_again_and_holds_the_next_one_back() -> None:
    # Soak: the old leader journaled hang:node0@157 and was killed before it sent it; the new
    # leader took it as fired and the fault never hit. A fault fired after the last decision
    # is fired again (if it did hit, its worker is already dead or stopped: nothing changes),
    # and the next one waits for its recovery (two faults at once could take both copies).
    m1 = Membership.initial(["a", "b"], 2)
    records = [{"action": "start", "membership": m1.to_dict()}, {"action": "fault_fired", "spec": "kill:b@10"}]
    ctl = _controller(["kill:b@10", "kill:a@11"])
    try:
        ctl.restore(records, now=100.0)
        assert [str(f) for f in ctl.injector.due(12, now=100.5)] == ["kill:b@10"]
        ctl.injector.fired(parse_fault("kill:b@10"), 100.5)
        assert ctl.injector.due(12, now=101.0) == []
    finally:
        ctl.server.close()


def test_a_resumed_run_starts_again_from_the_layout_it_had_without_its_fenced_nodes() -> None:
    # resil-run --resume: every process is new, so nothing counts as registered and no epoch
    # is current; the layout the job had last is its first epoch once every worker is back.
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0")
    records: list[dict[str, Any]] = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "fault_fired", "spec": "kill:b@10"},
        {"action": "replace_node", "node": "b", "spare": "s0", "membership": m2.to_dict(), "committed_step": 12},
    ]
    ctl = _controller(["kill:b@10", "kill:a@50"])
    try:
        ctl.resume(records)
        v = ctl.view
        assert v.membership is None and ctl.max_step == 0 and ctl.result is None
        assert ctl.state.initial.node_ranks == {"a": (0, 1), "s0": (2, 3)} and ctl.state.initial.world_size == 4
        assert v.nodes["b"].role == NodeRole.FENCED and v.nodes["s0"].role == NodeRole.ACTIVE
        assert v.nodes["s1"].role == NodeRole.SPARE
        assert not any(x.registered for x in v.nodes.values())  # every node process is new
        assert ctl.state.unregistered == 4
        assert [str(f) for f in ctl.injector.pending] == ["kill:a@50"]
        assert not ctl.restored  # a new run: it says job_started
    finally:
        ctl.server.close()


def test_restore_before_the_first_epoch_keeps_start_up_replacements() -> None:
    records = [{"action": "replace_node", "node": "a", "spare": "s1", "membership": None, "reason": "lost"}]
    ctl = _controller()
    try:
        ctl.restore(records, now=5.0)
        assert ctl.view.membership is None
        assert set(ctl.state.initial.node_ranks) == {"s1", "b"} and ctl.state.initial.epoch == 1
        assert ctl.state.unregistered == 4  # every worker registers (again) before epoch 1
    finally:
        ctl.server.close()


def test_restore_of_a_finished_job_keeps_its_verdict() -> None:
    ctl = _controller()
    try:
        ctl.restore(
            [
                {"action": "start", "membership": Membership.initial(["a", "b"], 2).to_dict()},
                {"action": "finish", "reason": "all 4 ranks finished"},
            ],
            now=1.0,
        )
        assert ctl.result is not None and ctl.result.exit_code == 0
    finally:
        ctl.server.close()


def test_peers_follow_the_highest_term_only() -> None:
    ctx = zmq.Context()
    cs = ControllerSet(ctx, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"], None, "n/node")
    try:
        assert cs.leader is None  # until someone leads, sends go to all
        assert not cs.follow(1, 0)  # the first leader: nothing to tell it again
        assert cs.leader == 0 and cs.term == 1
        assert not cs.follow(1, 2) and cs.leader == 0  # same term, another replica: ignored
        assert cs.follow(3, 2) and cs.leader == 2  # a newer leader: register with it
        assert not cs.follow(2, 1) and cs.leader == 2  # a deposed leader's older term
        assert not cs.follow(9, 7)  # no such replica
        assert cs.follow(4, 2)  # the same replica restarted with a new term: register again
    finally:
        cs.close()
        ctx.term()


def test_a_node_an_epoch_behind_after_a_takeover_gets_its_view_again() -> None:
    """A node still at the old epoch when a standby takes over: its first heartbeat must get
    its view of the current epoch, with the floor the old leader announced. The resend
    throttle's clock (`membership_sent_s`) was never declared on NodeView, so the heartbeat
    handler raised AttributeError instead."""
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0").with_committed(30)
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {
            "action": "replace_node",
            "node": "b",
            "spare": "s0",
            "membership": m2.to_dict(),
            "committed_step": 30,
            "reason": "b failed",
        },
    ]
    ctl = _controller()
    ctx = zmq.Context()
    try:
        ctl.restore(records, now=100.0)
        node = connect(ctx, ctl.endpoint, None, "a/node")
        node.send(MsgType.HEARTBEAT, {"node": "a", "epoch": 1, "pid": 7})  # the ROUTER learns the peer
        got = None
        for _ in range(50):
            got = ctl.ch.recv(0.1)
            if got is not None:
                break
        assert got is not None and peer_name(got[0]) == b"a/node"
        ctl._handle(got[0], got[1], 101.0)  # raised AttributeError before the fix
        assert ctl.view.nodes["a"].epoch_sent == 2
        sent = [m for _, m in iter(lambda: _recv(node), None) if m.type == MsgType.MEMBERSHIP]
        assert [Membership.from_dict(m.body) for m in sent] == [m2.view("a")]
        assert sent[0].body["committed"] == 30
    finally:
        ctl.server.close()
        ctx.destroy(linger=0)


def test_after_a_takeover_a_node_hears_the_lease_before_anything_else() -> None:
    # Soak: a new leader restored "node/node" as each node's routing id (ids carry a random
    # nonce now), so its first lease went nowhere; an INJECT it sent once the node was
    # heard reached a node still following the stalled old leader, which dropped it.
    m1 = Membership.initial(["a", "b"], 2)
    ctl = _controller(["xid79:a@5"])
    ctx = zmq.Context()
    try:
        ctl.restore([{"action": "start", "membership": m1.to_dict()}], now=100.0)
        ctl.state.max_step = 10
        ctl.effects.fire_faults(100.0)
        assert [str(f) for f in ctl.injector.pending] == ["xid79:a@5"]  # a not heard yet: it waits
        node = connect(ctx, ctl.endpoint, None, "a/node")
        node.send(MsgType.HEARTBEAT, {"node": "a", "epoch": 1, "pid": 7})
        got = None
        for _ in range(50):
            if (got := ctl.ch.recv(0.1)) is not None:
                break
        assert got is not None
        ctl._handle(got[0], got[1], 100.2)
        ctl.state.awaiting_full_strength = None
        ctl.effects.fire_faults(100.3)
        types = [m.type for _, m in iter(lambda: _recv(node), None)]
        assert types and types[0] == MsgType.LEASE and MsgType.INJECT in types, types
    finally:
        ctl.server.close()
        ctx.destroy(linger=0)


def _recv(ch: Channel) -> tuple[bytes | None, Message] | None:
    return ch.recv(0.5)


def test_a_fault_aimed_at_a_fenced_node_is_dropped_and_holds_nothing_back() -> None:
    # Left pending, a fault that can never hit would be "the earliest step's" for ever and
    # hold every later fault back.
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0")
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "replace_node", "node": "b", "spare": "s0", "membership": m2.to_dict(), "committed_step": 12},
    ]
    ctl = _controller(["kill:b@50", "kill:a@60"])
    try:
        ctl.restore(records, now=100.0)
        ctl.state.awaiting_full_strength = None
        ctl.state.max_step = 70
        ctl.state.node_ident["a"] = b"a/node#00"  # a has been heard
        ctl.effects.fire_faults(100.1)  # kill:b@50: b is fenced
        assert [str(f) for f in ctl.injector.pending] == ["kill:a@60"]
        ctl.effects.fire_faults(100.2)
        assert ctl.injector.pending == []
    finally:
        ctl.server.close()


def test_a_failed_spare_settles_the_fault_that_hit_it() -> None:
    # A spare's failure brings no new epoch: without this the next fault waited settle_s.
    from resild.controller.policy import Action, Decision

    m1 = Membership.initial(["a", "b"], 2)
    ctl = _controller(["kill:s1@5", "kill:a@6"])
    try:
        ctl.restore([{"action": "start", "membership": m1.to_dict()}], now=100.0)
        ctl.state.awaiting_full_strength = None
        ctl.state.max_step = 10
        ctl.state.node_ident.update({"a": b"a/node#0", "s1": b"s1/node#0"})
        ctl.effects.fire_faults(100.0)  # kill:s1@5
        assert [str(f) for f in ctl.injector.pending] == ["kill:a@6"] and ctl.injector.unsettled(100.1)
        ctl.effects.decide(Decision(Action.DROP_SPARE, "s1 failed", node="s1"), 100.2)
        assert not ctl.injector.unsettled(100.3)
        ctl.effects.fire_faults(100.3)
        assert ctl.injector.pending == []
    finally:
        ctl.server.close()


def test_a_new_leader_keeps_a_shrink_a_grow_and_the_replica_unit() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    shrunk = m1.shrink("b")
    grown = shrunk.grow("s0", 2)
    records = [
        {"action": "start", "membership": m1.to_dict()},
        {"action": "replica_unit", "ranks": 2},
        {"action": "shrink", "node": "b", "membership": shrunk.to_dict(), "committed_step": 7, "reason": "b failed"},
        {"action": "grow", "spare": "s0", "membership": grown.to_dict(), "committed_step": 9, "reason": "s0 joins"},
    ]
    # every record the journal writes reads back as itself
    assert [parse_record(r).to_dict()["action"] for r in records] == ["start", "replica_unit", "shrink", "grow"]
    assert parse_record(records[1]) == ReplicaUnit(2)
    ctl = _controller()
    try:
        ctl.restore(records[:3], now=10.0)
        assert ctl.view.membership == shrunk.with_committed(7)
        assert ctl.view.nodes["b"].role == NodeRole.FENCED and ctl.view.replica_ranks == 2
        ctl.restore(records, now=11.0)
        assert ctl.view.membership == grown.with_committed(9)
        roles = {n: x.role for n, x in ctl.view.nodes.items()}
        assert roles == {"a": NodeRole.ACTIVE, "b": NodeRole.FENCED, "s0": NodeRole.ACTIVE, "s1": NodeRole.SPARE}
    finally:
        ctl.server.close()


# ---- the fold itself (restore.apply), on records alone: shrink and grow ----------------------
def _restored() -> Restored:
    """Epoch 1 of a, b (2 ranks each) with spare s0 and a node j0 the job admitted later."""
    m1 = Membership.initial(["a", "b"], 2)
    roles = {"a": NodeRole.ACTIVE, "b": NodeRole.ACTIVE, "s0": NodeRole.SPARE}
    s = fold([Start(m1), Admit(("j0",), "joined")], Restored(roles, dict.fromkeys(roles, ""), m1))
    assert s.roles["j0"] == NodeRole.SPARE and s.membership == m1
    return s


def test_folding_a_shrink_fences_the_node_and_takes_the_shrunk_epoch_with_its_floor() -> None:
    before = _restored()
    shrunk = Membership.initial(["a", "b"], 2).shrink("a")  # b renumbered 0-1
    s = apply(before, Shrink("a failed (Xid 79); no spare left: 2 replicas train on", "a", None, shrunk, 17, 5.0))
    assert s.membership == Membership(2, 2, {"b": (0, 1)}, committed=17)
    assert s.roles == {"a": NodeRole.FENCED, "b": NodeRole.ACTIVE, "s0": NodeRole.SPARE, "j0": NodeRole.SPARE}
    assert s.reasons["a"] == "a failed (Xid 79); no spare left: 2 replicas train on" and s.reasons["b"] == ""
    assert s.max_step == 17 and s.result is None
    assert s.initial == before.initial  # the first epoch as it was
    # a floor the epoch already carried, higher than the record's step, is kept
    assert apply(before, Shrink("x", "a", None, shrunk.with_committed(20), 17)).membership == shrunk.with_committed(20)


def test_folding_a_grow_makes_the_spare_active_and_takes_the_grown_epoch() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    shrunk, grown = m1.shrink("a"), m1.shrink("a").grow("j0", 2)
    s = fold(
        [Shrink("a failed", "a", None, shrunk, 17), Grow("j0 joins: 2 of 2 replicas", None, "j0", grown, 25)],
        _restored(),
    )
    assert s.membership == Membership(3, 4, {"b": (0, 1), "j0": (2, 3)}, committed=25)
    assert s.roles == {"a": NodeRole.FENCED, "b": NodeRole.ACTIVE, "s0": NodeRole.SPARE, "j0": NodeRole.ACTIVE}
    assert s.reasons["j0"] == "" and s.reasons["a"] == "a failed"  # a grow fences nobody
    assert s.max_step == 25 and s.result is None and s.unsettled == frozenset()


def test_shrink_and_grow_records_read_back_as_themselves() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    shrunk = m1.shrink("a").with_committed(17)
    grown = shrunk.grow("j0", 2)
    shrink = decided(Decision(Action.SHRINK, "a failed", node="a", membership=shrunk, detector="heartbeat"), 17, 5.0)
    grow = decided(Decision(Action.GROW, "j0 joins", spare="j0", membership=grown), 25, 6.0)
    assert shrink == Shrink("a failed", "a", None, shrunk, 17, 5.0)
    assert grow == Grow("j0 joins", None, "j0", grown, 25, 6.0)
    assert shrink.to_dict() == {
        "t_wall": 5.0,
        "action": "shrink",
        "reason": "a failed",
        "node": "a",
        "spare": None,
        "membership": {"epoch": 2, "world_size": 2, "node_ranks": {"b": [0, 1]}, "committed": 17},
        "committed_step": 17,
    }
    assert grow.to_dict()["action"] == "grow" and grow.to_dict()["spare"] == "j0"
    for rec in (shrink, grow):
        back = parse_record(json.loads(json.dumps(rec.to_dict())))
        assert back == rec and type(back) is type(rec)
