"""A leader that was stopped (SIGSTOP, a paused VM) and resumes must not act on a world
that moved on: the time it did not run counts against nobody, and a decision the
replicated journal did not commit is carried out by nobody. (Found by the system soak:
a resumed leader fenced a healthy spare as "no heartbeat for 2.2s" and killed it.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from resild.controller.journal import Journal
from resild.controller.loop import Controller, ControllerConfig
from resild.controller.policy import STALL_S, PolicyConfig, check_heartbeats, controller_stall_s
from resild.controller.view import ClusterView, NodeView
from resild.events.log import EventLog
from resild.membership import NodeRole
from resild.wire.channel import Server, connect
from resild.wire.keys import generate_keys
from resild.wire.protocol import PROTOCOL_VERSION, Message, MsgType


def test_a_late_tick_is_the_controllers_own_stall() -> None:
    assert controller_stall_s(10.0, 10.0) == 0.0
    assert controller_stall_s(10.0 + STALL_S / 2, 10.0) == 0.0  # a busy moment
    assert controller_stall_s(13.0, 10.0) == 3.0
    assert controller_stall_s(13.0, 0.0) == 0.0  # the first tick has no due time


def test_time_nobody_watched_counts_against_nobody() -> None:
    nodes = {n: NodeView(n, NodeRole.ACTIVE, 1, registered=True) for n in ("a", "b")}
    view = ClusterView(nodes)
    view.beat("a", 100.0)  # silent for a while already
    view.beat("b", 103.0)
    cfg = PolicyConfig(heartbeat_timeout_s=4.0, start_heartbeat_timeout_s=4.0)
    stopped_s = 5.0  # the controller did not run from 103.5 to 108.5
    view.shift_clock(stopped_s)
    assert check_heartbeats(108.6, view, cfg).node is None  # b: 0.6 s of watched silence
    d = check_heartbeats(109.2, view, cfg)  # a: 4.2 s watched (100 -> 103.5, then 108.5 -> 109.2)
    assert d.node == "a", d


class RefusingJournal(Journal):
    """A replicated journal whose replicas stopped committing (this replica was deposed)."""

    replicated = True

    def __init__(self) -> None:
        super().__init__(None)
        self.commit = True
        self.refused: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> bool:
        if not self.commit:
            self.refused.append(record)
        return self.commit


def _msg(mtype: MsgType, body: dict[str, Any]) -> Message:
    return Message(mtype, "t", 1, time.time() + 60, body, PROTOCOL_VERSION)


Rig = tuple[Controller, RefusingJournal, EventLog, list[str]]


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A controller for 2 active nodes and a spare over a journal that may refuse; the
    nodes it fences are recorded instead of killed."""
    ctx = zmq.Context()
    journal = RefusingJournal()
    events = EventLog(None)
    ctl = Controller(ControllerConfig(), ["n0", "n1"], ["n2"], 1, None, events, journal, ctx=ctx)
    fenced: list[str] = []
    ctl.backend.fence = lambda node, reason: fenced.append(node)  # type: ignore[method-assign]
    try:
        yield ctl, journal, events, fenced
    finally:
        ctl.server.close()
        events.close()
        ctx.destroy(linger=0)


def register(ctl: Controller, now: float) -> None:
    for i, n in enumerate(["n0", "n1", "n2"]):
        ctl._handle(f"{n}/node".encode(), _msg(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i}), now)
        ctl._handle(
            f"{n}/w0/1".encode(), _msg(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i}), now
        )


def test_a_decision_the_replicas_did_not_commit_is_not_carried_out(rig: Rig) -> None:
    ctl, journal, events, fenced = rig
    now = time.monotonic()
    journal.commit = False
    register(ctl, now)
    assert ctl.view.membership is None  # the first epoch was not committed: not announced
    journal.commit = True
    ctl._tick(now + 0.1)
    m = ctl.view.membership
    assert m is not None and m.epoch == 1  # committed at the next tick: announced

    # Deposed: every node "silent" past the heartbeat timeout is what a resumed
    # leader sees; its decision is refused by the replicas, so nothing happens.
    journal.commit = False
    ctl._tick(now + 60.0)
    assert journal.refused and ctl.state.deferred >= 1
    assert fenced == [] and ctl.view.membership is m
    assert all(v.role != NodeRole.FENCED for v in ctl.view.nodes.values())
    assert not [e for e in events.records if e["event"] in ("failure_detected", "node_fenced", "spare_assigned")]


def test_a_failure_reported_while_the_replicas_refused_is_handled_once_they_commit(rig: Rig) -> None:
    """A worker's exit arrives as a message: no tick would decide it again by itself."""
    ctl, journal, events, fenced = rig
    now = time.monotonic()
    register(ctl, now)
    m1 = ctl.view.membership
    assert m1 is not None
    journal.commit = False  # the standbys are stalled: no majority
    exit_msg = {"node": "n0", "local_rank": 0, "pid": 200, "returncode": 1}
    ctl._handle(b"n0/node", _msg(MsgType.WORKER_EXIT, exit_msg), now)
    ctl._tick(now + 0.1)
    assert fenced == [] and ctl.view.membership is m1
    journal.commit = True  # they are back
    ctl._tick(now + 0.2)
    m2 = ctl.view.membership
    assert fenced == ["n0"] and m2 is not None and m2.epoch == 2 and "n2" in m2.node_ranks
    ctl._tick(now + 0.3)  # handled once
    assert fenced == ["n0"] and ctl.view.membership is m2


def test_a_deposed_leader_keeps_the_replicas_socket_and_serves_on_it(tmp_path: Path) -> None:
    """A replica's ROUTER (and its ZAP authenticator) outlives each leadership: closing and
    binding them again raced libzmq's asynchronous close ('Address already in use' on
    inproc://zeromq.zap.01: a deposed replica died instead of standing by, seen in a gate)."""
    keys = generate_keys(tmp_path / "keys", nodes=["n0"])
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    client = connect(ctx, server.endpoint, keys.node("n0"), "n0/node")
    leads = [True]
    try:
        for _ in range(2):  # leads, is deposed, stands by, leads again: the same socket
            ctl = Controller(
                ControllerConfig(),
                ["n0"],
                [],
                1,
                keys,
                EventLog(None),
                RefusingJournal(),
                ctx=ctx,
                server=server,
                leadership=lambda: leads[0],
            )
            leads[0] = False
            result = ctl.run()
            assert ctl.deposed and result.exit_code == 1
            assert ctl.ch.on_refused is None  # the dead controller hears nothing more
            client.send(MsgType.HEARTBEAT, {"node": "n0"})
            got = server.channel.recv(5.0)  # standing by: still bound, still authenticating
            assert got is not None and got[1].sender == "n0/node"
            leads[0] = True
    finally:
        client.close()
        server.close()
        ctx.destroy(linger=0)
    own = Controller(ControllerConfig(), ["n0"], [], 1, None, EventLog(None), RefusingJournal(), ctx=zmq.Context())
    own.finish()
    assert own.server.channel.sock.closed  # a controller's own socket goes with it
    own.ctx.destroy(linger=0)


def test_a_node_reporting_to_us_as_its_old_leader_is_leased_by_its_first_commit_report(rig: Rig) -> None:
    """A replica that led, was deposed and leads again: a node that never followed the leader
    in between still takes it for its leader and sends it commit reports only (a leader gets
    no periodic heartbeat while reports flow). Its first report must get it our lease, or it
    leaves after --controller-timeout (found in a gate)."""
    ctl, _, _, _ = rig
    now = time.monotonic()
    register(ctl, now)
    m = ctl.view.membership
    assert m is not None
    sent: list[bytes] = []
    ctl.bc.send_raw = lambda ident, frame: sent.append(ident)  # type: ignore[method-assign]
    ctl.state.node_ident.pop("n0")  # this leader has not heard n0's socket yet
    report = {"node": "n0", "epoch": m.epoch, "state": "commit", "commits": {"0": 11}}
    ctl._handle(b"n0/node", _msg(MsgType.PROGRESS, report), now + 1.0)
    assert ctl.state.node_ident["n0"] == b"n0/node" and sent == [b"n0/node"]  # leased at once
    ctl._handle(b"n0/node", _msg(MsgType.PROGRESS, {**report, "commits": {"0": 12}}), now + 1.1)
    assert sent == [b"n0/node"]  # once: it follows us now
    assert ctl.view.nodes["n0"].last_heartbeat_s == pytest.approx(now + 1.1)  # a report is its heartbeat
