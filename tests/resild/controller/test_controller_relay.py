"""The controller's side of the relay protocol, against fake node processes (real
sockets, no processes): one message per node per epoch, deltas to nodes holding the
previous epoch, its view to a node that does not (or that says it missed one), the
full layout directly only to workers not behind a relay, aggregated commits, hang blame."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from resild.controller.backend import Backend
from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.events.log import EventLog
from resild.membership import Membership
from resild.wire.channel import Channel, connect
from resild.wire.protocol import Message, MsgType
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)


def drain(ch: Channel, wait_s: float = 0.3) -> list[Message]:
    out, deadline = [], time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        got = ch.recv(left)
        if got is not None:
            out.append(got[1])
    return out


def until(ch: Channel, kind: MsgType, timeout_s: float = 10.0) -> list[Message]:
    """Every message up to the first of `kind` (a fresh CURVE connection on a loaded machine
    can take longer than a fixed drain), then whatever follows within a short drain."""
    out, deadline = [], time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0 and not any(m.type == kind for m in out):
        got = ch.recv(left)
        if got is not None:
            out.append(got[1])
    return out + drain(ch)


def memberships(msgs: list[Message]) -> list[Message]:
    return [m for m in msgs if m.type in (MsgType.MEMBERSHIP, MsgType.MEMBERSHIP_DELTA)]


def wait_event(events: EventLog, name: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in list(events.records):
            if e["event"] == name:
                return e
        time.sleep(0.02)
    raise AssertionError(f"no {name} event; got {[(e['event'], e.get('cause')) for e in events.records]}")


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Controller, EventLog, zmq.Context]]:
    events = EventLog(None)
    hang_s = getattr(request, "param", 30.0)
    cfg = ControllerConfig(
        settings=JobSettings(heartbeat_timeout_s=30.0, hang_timeout_s=hang_s, controller_timeout_s=0),
        resync_s=1.5,
    )
    ctl = Controller(cfg, ["a", "b"], ["s0", "s1"], 2, None, events)
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    ctx = zmq.Context()
    try:
        yield ctl, events, ctx
    finally:
        ctl.result = JobResult(1, "test over")
        th.join(10)
        ctx.destroy(linger=0)


def test_deltas_full_layouts_resync_and_direct_workers(cluster: tuple[Controller, EventLog, zmq.Context]) -> None:
    ctl, events, ctx = cluster
    nodes = {n: connect(ctx, ctl.endpoint, None, f"{n}/node") for n in ("a", "b", "s0", "s1")}
    for n, ch in nodes.items():
        relayed = [] if n == "b" else [0, 1]  # b's workers talk to the controller directly
        ch.send(MsgType.REGISTER_NODE, {"node": n, "pid": 1, "nproc": 2, "epoch": 0, "relayed": relayed})
    time.sleep(0.2)
    for n in ("a", "s0", "s1"):  # relayed workers register (over the node's socket here)
        for lr in (0, 1):
            nodes[n].send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": lr, "pid": 1})
    b_workers = [connect(ctx, ctl.endpoint, None, f"b/w{lr}/1") for lr in (0, 1)]
    for lr, w in enumerate(b_workers):
        w.send(MsgType.REGISTER_WORKER, {"node": "b", "local_rank": lr, "pid": 1})
    m1 = Membership.initial(["a", "b"], 2)

    # Epoch 1: one view per node process; b's direct workers get the full layout; a's none.
    got_a = memberships(drain(nodes["a"]))
    assert [(m.type, Membership.from_dict(m.body)) for m in got_a] == [(MsgType.MEMBERSHIP, m1.view("a"))]
    assert Membership.from_dict(got_a[0].body).rank_of("a", 1) == 1
    assert len(memberships(drain(nodes["b"]))) == 1
    for w in b_workers:
        (m,) = memberships(drain(w))
        assert Membership.from_dict(m.body) == m1
    assert memberships(drain(nodes["s0"], 0.05)) == []  # spares hold no ranks

    # Every rank commits step 7: the committed floor of the next epoch.
    for n, ranks in (("a", (0, 1)), ("b", (2, 3))):
        commits = {str(r): 7 for r in ranks}
        nodes[n].send(MsgType.PROGRESS, {"node": n, "epoch": 1, "state": "commit", "commits": commits})
    deadline = time.monotonic() + 5
    while ctl.max_step < 7 and time.monotonic() < deadline:
        time.sleep(0.01)

    # b fails: a held epoch 1 -> a delta; s0 held nothing -> its view. Both carry the floor.
    # The decision is journaled; the new epoch goes out before b is fenced (the critical path).
    fenced_at: dict[str, tuple[int, int]] = {}

    class Watch(Backend):
        def fence(self, node: str, reason: str) -> None:
            fenced_at[node] = (ctl.view.nodes["a"].epoch_sent, ctl.view.nodes["s0"].epoch_sent)

    ctl.backend = Watch()
    nodes["b"].send(MsgType.WORKER_EXIT, {"node": "b", "local_rank": 0, "pid": 1, "returncode": -9})
    m2 = m1.replace("b", "s0").with_committed(7)
    (d,) = memberships(drain(nodes["a"]))
    assert d.type == MsgType.MEMBERSHIP_DELTA and d.body == {
        "epoch": 2,
        "base": 1,
        "world_size": 4,
        "moves": {"b": "s0"},
        "committed": 7,
    }
    assert m1.apply_delta(d.body) == m2 and m1.view("a").apply_delta(d.body) == m2.view("a")
    (f,) = memberships(drain(nodes["s0"]))
    assert f.type == MsgType.MEMBERSHIP and Membership.from_dict(f.body) == m2.view("s0")
    assert Membership.from_dict(f.body).rank_of("s0", 0) == 2 and f.body["committed"] == 7
    ev = wait_event(events, "membership") and [e for e in events.records if e["event"] == "membership"][-1]
    assert (ev["epoch"], ev["view"], ev["delta"], ev["direct"], ev["committed"]) == (2, 1, 1, 0, 7)
    assert ev["layout"] == {"a": [0, 1], "s0": [2, 3]}  # the event log keeps the whole layout
    assert fenced_at == {"b": (2, 2)}  # a (delta) and s0 (view) were sent epoch 2 before b was fenced

    # a says it still holds epoch 1 (the delta was lost): right after the send, no
    # resend; once resync_s has passed, its view. With "resync" at once.
    nodes["a"].send(MsgType.HEARTBEAT, {"node": "a", "epoch": 1})
    assert memberships(drain(nodes["a"], 0.1)) == []
    time.sleep(1.0)
    nodes["a"].send(MsgType.HEARTBEAT, {"node": "a", "epoch": 1})
    (f,) = memberships(drain(nodes["a"]))
    assert f.type == MsgType.MEMBERSHIP and Membership.from_dict(f.body) == m2.view("a")
    nodes["a"].send(MsgType.HEARTBEAT, {"node": "a", "epoch": 1, "resync": True})
    (f,) = memberships(drain(nodes["a"]))
    assert Membership.from_dict(f.body) == m2.view("a")
    nodes["a"].send(MsgType.HEARTBEAT, {"node": "a", "epoch": 2})
    assert memberships(drain(nodes["a"], 0.5)) == []
    # A restarted node process (registers again) gets its view.
    nodes["a"].send(MsgType.REGISTER_NODE, {"node": "a", "pid": 2, "nproc": 2, "epoch": 0, "relayed": [0, 1]})
    (f,) = memberships(drain(nodes["a"]))
    assert Membership.from_dict(f.body) == m2.view("a")
    # A direct worker registering late gets the full layout directly; a relayed one does not.
    late = connect(ctx, ctl.endpoint, None, "s0/wlate/1")
    late.send(MsgType.REGISTER_WORKER, {"node": "s0", "local_rank": 1, "pid": 1})
    assert memberships(drain(late)) == []  # s0 relays local rank 1: its node hands it over
    nodes["s0"].send(MsgType.HEARTBEAT, {"node": "s0", "epoch": 2, "relayed": [0]})
    time.sleep(0.1)
    late.send(MsgType.REGISTER_WORKER, {"node": "s0", "local_rank": 1, "pid": 1})
    (f,) = memberships(drain(late))
    assert Membership.from_dict(f.body) == m2


@pytest.mark.parametrize("cluster", [1.0], indirect=True)  # hang timeout
def test_aggregated_commits_and_relayed_waits_name_the_hung_rank(
    cluster: tuple[Controller, EventLog, zmq.Context],
) -> None:
    ctl, events, ctx = cluster
    nodes = {n: connect(ctx, ctl.endpoint, None, f"{n}/node") for n in ("a", "b", "s0")}
    for n, ch in nodes.items():
        ch.send(MsgType.REGISTER_NODE, {"node": n, "pid": 1, "nproc": 2, "epoch": 0, "relayed": [0, 1]})
        for lr in (0, 1):
            ch.send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": lr, "pid": 1})
    wait_event(events, "membership")
    nodes["a"].send(MsgType.PROGRESS, {"node": "a", "epoch": 1, "state": "commit", "commits": {"0": 5, "1": 5}})
    nodes["b"].send(MsgType.PROGRESS, {"node": "b", "epoch": 1, "state": "commit", "commits": {"2": 5, "3": 5}})
    full = wait_event(events, "full_strength_step")
    assert full["epoch"] == 1 and full["step"] == 5
    # ranks 0, 1, 3 blocked in the collective (forwarded at once by their node); rank 2 is silent
    for rank, n in ((0, "a"), (1, "a"), (3, "b")):
        nodes[n].send(MsgType.PROGRESS, {"node": n, "rank": rank, "epoch": 1, "step": 5, "state": "wait"})
    # commits for a rank of another node are ignored (a node speaks for its own ranks only)
    nodes["a"].send(MsgType.PROGRESS, {"node": "a", "epoch": 1, "state": "commit", "commits": {"2": 6}})
    fail = wait_event(events, "failure_detected", 10.0)
    assert fail["node"] == "b" and fail["detector"] == "hang"
    assert "rank 2 " in fail["cause"] and "last step 5, state commit" in fail["cause"], fail
    assert ctl.max_step == 5


def test_a_node_process_commit_report_is_its_heartbeat_and_silence_is_still_a_loss() -> None:
    events = EventLog(None)
    cfg = ControllerConfig(settings=JobSettings(heartbeat_timeout_s=1.0, controller_timeout_s=0))
    ctl = Controller(cfg, ["a", "b"], ["s0"], 1, None, events)
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    ctx = zmq.Context()
    try:
        nodes = {n: connect(ctx, ctl.endpoint, None, f"{n}/node") for n in ("a", "b", "s0")}
        for n, ch in nodes.items():
            ch.send(MsgType.REGISTER_NODE, {"node": n, "pid": 1, "nproc": 1, "epoch": 0, "relayed": [0]})
            ch.send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 1})
            ch.send(MsgType.HEARTBEAT, {"node": n, "epoch": 0})
        wait_event(events, "membership")
        # 2.5 heartbeat timeouts: a only reports commits, b and the spare only heartbeat
        for step in range(1, 26):
            nodes["a"].send(MsgType.PROGRESS, {"node": "a", "epoch": 1, "state": "commit", "commits": {"0": step}})
            for n in ("b", "s0"):
                nodes[n].send(MsgType.HEARTBEAT, {"node": n, "epoch": 1})
            time.sleep(0.1)
        assert not [e for e in events.records if e["event"] == "failure_detected"]
        # a's reports go quiet (nothing else from it): lost after the timeout, as before
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0 and not [e for e in events.records if e["event"] == "failure_detected"]:
            for n in ("b", "s0"):
                nodes[n].send(MsgType.HEARTBEAT, {"node": n, "epoch": 1})
            time.sleep(0.1)
        fail = wait_event(events, "failure_detected", 1.0)
        assert fail["node"] == "a" and fail["detector"] == "heartbeat", fail
    finally:
        ctl.result = JobResult(1, "test over")
        th.join(10)
        ctx.destroy(linger=0)


def test_a_workers_welcome_names_its_nodes_role(cluster: tuple[Controller, EventLog, zmq.Context]) -> None:
    """A spare's worker is told it is one (it starts its warm-up at once), an active
    node's worker is told it is active (it never fetches the warm-up recipe)."""
    ctl, events, ctx = cluster
    # Kept: a channel dropped at once closes its socket (linger 0) with its message unsent.
    nodes = [connect(ctx, ctl.endpoint, None, f"{n}/node") for n in ("a", "s0")]
    for ch, n in zip(nodes, ("a", "s0")):
        ch.send(MsgType.REGISTER_NODE, {"node": n, "pid": 1, "nproc": 2, "epoch": 0, "relayed": []})
    deadline = time.monotonic() + 10
    while len({e["node"] for e in list(events.records) if e["event"] == "node_registered"}) < 2:
        assert time.monotonic() < deadline, [e["event"] for e in events.records]
        time.sleep(0.02)
    roles = {}
    for n in ("a", "s0", "a"):  # the second active worker gets the same encoding
        lr = 1 if n == "a" and n in roles else 0
        w = connect(ctx, ctl.endpoint, None, f"{n}/w{lr}/1")
        w.send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": lr, "pid": 1})
        got = until(w, MsgType.WELCOME)
        welcome = [m for m in got if m.type == MsgType.WELCOME]
        assert len(welcome) == 1 and welcome[0].body["collective_timeout_s"] > 0, (n, lr, got, w.rejected)
        roles.setdefault(n, []).append(welcome[0].body["role"])
    assert roles == {"a": ["active", "active"], "s0": ["spare"]}
