"""The node-local relay: pure parts (layout tracking, commit aggregation), the socket
pair, and the whole path (real controller, real node processes, stub workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from launcher.node.relay import CommitAggregator, LayoutTracker, RelayServer, leader_heartbeat_due
from launcher.run.local import LocalCluster
from launcher.worker.links.relay import RelayClient, wait_for
from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.events.log import EventLog
from resild.membership import Membership
from resild.wire.keys import generate_keys
from resild.wire.leader import ControllerSet
from resild.wire.protocol import MsgType
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(120)

STUB = Path(__file__).with_name("relay_stub.py")


# ---- LayoutTracker -----------------------------------------------------------------------


def test_tracker_applies_deltas_and_asks_for_the_full_layout_after_a_gap() -> None:
    m1 = Membership.initial(["a", "b", "c"], 2)
    m2 = m1.replace("b", "s0")
    m3 = m2.replace("c", "s1")
    t = LayoutTracker()
    assert t.on_delta(m2.delta_from(m1)) is None  # holds nothing: needs the full layout
    assert t.on_layout(m1.to_dict()) and t.membership == m1
    assert t.on_delta(m2.delta_from(m1)) is True and t.membership == m2
    assert t.on_delta(m2.delta_from(m1)) is False  # old news
    assert t.on_layout(m1.to_dict()) is False and t.epoch == 2
    t2 = LayoutTracker(m1)
    assert t2.on_delta(m3.delta_from(m2)) is None and t2.membership == m1  # missed epoch 2
    assert t2.on_layout(m3.to_dict()) and t2.membership == m3


def test_tracker_keeps_the_committed_floor_and_asks_again_for_a_malformed_epoch() -> None:
    m1 = Membership.initial(["a", "b"], 2)
    m2 = m1.replace("b", "s0").with_committed(12)
    t = LayoutTracker(m1.view("a"))
    assert t.on_delta(m2.delta_from(m1)) is True and t.membership == m2.view("a")
    assert t.membership.to_dict()["committed"] == 12  # what the relay hands its workers
    m3 = m2.replace("a", "s1")
    for bad in ({**m3.delta_from(m2), "committed": -1}, {"epoch": 3, "base": 2}, {"epoch": "x"}):
        assert t.on_delta(bad) is None and t.epoch == 2  # the controller sends the view again
    assert t.on_layout({**m3.view("s1").to_dict(), "committed": "12"}) is None and t.epoch == 2


# ---- CommitAggregator ------------------------------------------------------------------------


def test_one_report_per_node_commit() -> None:
    a = CommitAggregator(interval_s=0.1, expected=2, _last_epoch=1)  # epoch 1 already reported
    a.add(0, 1, 5, now=10.0)
    assert not a.due(10.0)  # rank 1 has not committed step 5 yet
    a.add(1, 1, 5, now=10.001)
    assert a.due(10.001)
    assert a.take(10.001) == {"epoch": 1, "state": "commit", "commits": {"0": 5, "1": 5}}
    assert a.take(10.002) is None and not a.due(10.5)


def test_a_report_carries_each_ranks_mean_pace_since_its_last_one_and_the_steps_asked_for() -> None:
    a = CommitAggregator(interval_s=0.1, expected=2, _last_epoch=1)
    a.add(0, 1, 5, 10.0, paced_s=0.5, of=100)
    a.add(1, 1, 5, 10.0, paced_s=0.6, of=100)
    first = a.take(10.0)
    assert first is not None and "paces" not in first and first["of"] == 100  # nothing to compare with yet
    a.add(0, 1, 9, 10.2, paced_s=0.9)  # four steps, 0.4 s of its own compute
    a.add(1, 1, 9, 10.2, paced_s=1.8)  # four steps, 1.2 s: the slow one
    assert a.take(10.2)["paces"] == {"0": 0.1, "1": 0.3}  # type: ignore[index]
    a.add(0, 2, 7, 10.4, paced_s=0.05)  # a spare's new process, or a rollback: counting starts again
    assert "paces" not in a.take(10.4)  # type: ignore[operator]
    a.add(0, 2, 8, 10.6, paced_s=0.15)
    assert a.take(10.6)["paces"] == {"0": 0.1}  # type: ignore[index]


def test_never_more_than_one_report_per_interval() -> None:
    a = CommitAggregator(interval_s=0.1, expected=1)
    a.add(0, 1, 1, now=0.0)
    assert a.take(0.0) is not None
    for i, t in enumerate((0.02, 0.04, 0.06, 0.08)):
        a.add(0, 1, 2 + i, now=t)
        assert not a.due(t)
    assert a.next_due_s() == pytest.approx(0.1)
    assert a.due(0.1) and a.take(0.1)["commits"] == {"0": 5}  # the latest step only


def test_a_lagging_rank_delays_the_report_at_most_one_interval() -> None:
    a = CommitAggregator(interval_s=0.1, expected=4, _last_epoch=1)
    a.add(0, 1, 7, now=1.0)
    a.add(1, 1, 7, now=1.0)
    assert not a.due(1.05) and a.next_due_s() == pytest.approx(1.1)
    assert a.due(1.1)


def test_a_new_epoch_drops_stale_commits_and_reports_at_once() -> None:
    a = CommitAggregator(interval_s=0.1, expected=2)
    a.add(0, 1, 7, now=0.0)
    a.add(1, 1, 7, now=0.0)
    a.take(0.0)
    a.add(0, 1, 8, now=0.2)  # epoch 1, then the re-form: epoch 2
    a.add(0, 2, 7, now=0.3)
    assert a.due(0.3)  # first commit of a new epoch: not held back for the others
    assert a.take(0.3) == {"epoch": 2, "state": "commit", "commits": {"0": 7}}
    a.add(1, 1, 9, now=0.31)  # a late commit of the old epoch is ignored
    assert a.take(0.5) is None


# ---- the socket pair -------------------------------------------------------------------------


def _pump(srv: RelayServer, until: float) -> list:
    got = []
    while time.monotonic() < until:
        srv.sock.poll(20)
        while (m := srv.recv()) is not None:
            got.append(m[1])
    return got


def test_a_worker_that_connects_late_gets_the_current_full_layout(tmp_path: Path) -> None:
    ctx = zmq.Context()
    srv = RelayServer(ctx, "n0", run_dir=str(tmp_path))
    try:
        assert (Path(srv.endpoint[len("ipc://") :]).stat().st_mode & 0o777) == 0o600
        early = RelayClient(srv.endpoint, "n0/w0/1", local_rank=0, ctx=ctx)
        _pump(srv, time.monotonic() + 0.3)
        assert early.recv(0) is None  # nothing to give yet
        m1 = Membership.initial(["n0", "n1"], 2)
        m2 = m1.replace("n1", "s")
        srv.set_membership(m1)
        srv.set_membership(m2)
        assert Membership.from_dict(wait_for(early, MsgType.MEMBERSHIP, 5).body) == m1
        assert Membership.from_dict(wait_for(early, MsgType.MEMBERSHIP, 5).body) == m2
        late = RelayClient(srv.endpoint, "n0/w1/2", local_rank=1, ctx=ctx)  # missed both announcements
        hello = _pump(srv, time.monotonic() + 0.3)
        assert [m.type for m in hello] == [MsgType.RELAY_HELLO] and sorted(srv.workers) == [0, 1]
        msg = wait_for(late, MsgType.MEMBERSHIP, 5)
        assert msg is not None and Membership.from_dict(msg.body) == m2
        late.send(MsgType.PROGRESS, {"node": "n0", "rank": 1, "epoch": 2, "step": 3, "state": "wait"})
        (prog,) = _pump(srv, time.monotonic() + 0.3)
        assert prog.type == MsgType.PROGRESS and prog.body["rank"] == 1
        srv.broadcast(MsgType.SHUTDOWN, {"reason": "done", "exit_code": 0})
        assert wait_for(late, MsgType.SHUTDOWN, 5) is not None
        early.close()
        late.close()
    finally:
        srv.close()
        ctx.term()


# ---- end to end: controller + node processes + stub workers ---------------------------------------


def _records(out: Path, name: str) -> list[dict]:
    f = out / f"{name}.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def test_relayed_path_hang_names_the_rank_late_worker_and_spare_get_full_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("STUB_OUT", str(out))
    monkeypatch.setenv("STUB_HANG_RANK", "3")  # local-node1, local rank 1
    monkeypatch.setenv("STUB_LATE", "node0/1")
    monkeypatch.setenv("RESILD_EXIT_GRACE_S", "2")
    keys = generate_keys(tmp_path / "keys")
    events = EventLog(None)
    settings = JobSettings(
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=10.0,
        hang_timeout_s=1.5,
        start_timeout_s=60.0,
        controller_timeout_s=0,
    )
    cfg = ControllerConfig(settings=settings)
    ctl = Controller(cfg, ["node0", "node1"], ["node2"], 2, keys, events)
    cluster = LocalCluster(["node0", "node1", "node2"], 2, [sys.executable, str(STUB)], tmp_path, settings=settings)
    cluster.start(ctl.endpoint, keys.path)
    ctl.backend = cluster
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    want = {"node0": {"node0": [0, 1]}, "node2": {"node2": [2, 3]}}  # each node relays its view

    def has_epoch2(name: str) -> bool:
        return any(r["epoch"] == 2 and r["source"] == "relay" for r in _records(out, name))

    try:
        deadline = time.monotonic() + 60
        names = ("node0-0", "node0-1", "node2-0", "node2-1")
        while time.monotonic() < deadline and not all(has_epoch2(n) for n in names):
            time.sleep(0.1)
        assert all(has_epoch2(n) for n in names), {n: _records(out, n) for n in names}
    finally:
        ctl.result = JobResult(1, "test over")
        th.join(30)
    ev = events.records
    (fail,) = [e for e in ev if e["event"] == "failure_detected"]
    assert fail["node"] == "node1" and fail["detector"] == "hang", fail
    assert "rank 3 " in fail["cause"], fail  # the relayed waits and aggregated commits named the hung rank
    mem = {e["epoch"]: e for e in ev if e["event"] == "membership"}
    assert mem[2]["delta"] == 1 and mem[2]["view"] == 1, mem[2]  # node0 held epoch 1, node2 did not
    assert mem[2]["direct"] == 0, mem[2]  # every worker is behind its relay now
    for n in names:
        got = [r for r in _records(out, n) if r["epoch"] == 2 and r["source"] == "relay"]
        assert got[0]["layout"] == want[n.split("-")[0]] and got[0]["world_size"] == 4, got
    # The late worker (connected after epoch 1 went out) got the current layout on its hello.
    late = _records(out, "node0-1")
    assert any(r["source"] == "direct" and r["epoch"] == 1 for r in late), late  # not relayed then
    first_relay = next(r for r in late if r["source"] == "relay")
    assert first_relay["epoch"] >= 1 and first_relay["layout"] == {"node0": [0, 1]}, late


def test_a_killed_node_process_relay_dir_is_swept_by_the_next(tmp_path: Path) -> None:
    """A SIGKILLed node process cannot remove its relay dir; the next node process on the host does,
    and only dirs whose owner is gone."""
    from launcher.node.relay import sweep_stale_relay_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"resild-relay-{dead.pid}-abc123"
    live = tmp_path / f"resild-relay-{os.getpid()}-def456"
    other = tmp_path / "resild-relay-notapid"
    for d in (stale, live, other):
        d.mkdir()
        (d / "relay.sock").touch()
    ctx = zmq.Context()
    try:
        srv = RelayServer(ctx, "n0", run_dir=str(tmp_path))
        assert not stale.exists() and live.exists() and other.exists()
        assert Path(srv.endpoint.removeprefix("ipc://")).parent.name.startswith(f"resild-relay-{os.getpid()}-")
        srv.close()
        assert sweep_stale_relay_dirs(str(tmp_path)) == []
    finally:
        ctx.destroy(linger=0)


def test_a_periodic_heartbeat_skips_the_leader_only_after_a_recent_commit_report() -> None:
    assert leader_heartbeat_due(now=10.0, last_report_s=-1e9, interval_s=0.25, news=False)
    assert not leader_heartbeat_due(now=10.0, last_report_s=9.9, interval_s=0.25, news=False)
    assert leader_heartbeat_due(now=10.0, last_report_s=9.75, interval_s=0.25, news=False)
    assert leader_heartbeat_due(now=10.0, last_report_s=9.99, interval_s=0.25, news=True)  # a new epoch held


def test_send_standbys_reaches_every_replica_but_the_leader() -> None:
    ctx = zmq.Context()
    try:
        routers = [ctx.socket(zmq.ROUTER) for _ in range(3)]
        ports = [r.bind_to_random_port("tcp://127.0.0.1") for r in routers]
        cs = ControllerSet(ctx, [f"tcp://127.0.0.1:{p}" for p in ports], None, "n0/node")
        cs.follow(term=1, leader=1)
        cs.send_standbys(MsgType.HEARTBEAT, {"node": "n0", "epoch": 1})
        got = [r.poll(500) for r in routers]
        assert [bool(g) for g in got] == [True, False, True]
        cs.close(linger_ms=0)
        for r in routers:
            r.close(linger=0)
    finally:
        ctx.term()
