"""One node's key holder floods the controller with EVENTs and keeps at it: the node is
named abusive and fenced (its ranks go to the spare, through the failure path), while the
job's other node keeps its lease, its place and its budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.controller.policy import AbuseLimits
from resild.events.log import EventLog
from resild.membership import NodeRole
from resild.wire.channel import Channel, connect
from resild.wire.keys import KeyDir, data_key, generate_keys
from resild.wire.protocol import Message, MsgType, encode
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)

NODES = ["a", "b", "s0"]


class _Nodes:
    """Every node's process and one worker, with the node's own key, on a thread: they
    register, heartbeat every 0.1 s, and keep what they get as (time, who, type, body)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: KeyDir) -> None:
        self.ctx, self.endpoint, self.keys = ctx, endpoint, keys
        self.got: list[tuple[float, str, MsgType, dict[str, Any]]] = []
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        chans: dict[str, Channel] = {}
        for i, n in enumerate(NODES):
            k = self.keys.node(n)
            chans[f"{n}/node"] = connect(self.ctx, self.endpoint, k, f"{n}/node")
            chans[f"{n}/node"].send(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i})
            chans[f"{n}/w0"] = connect(self.ctx, self.endpoint, k, f"{n}/w0/{200 + i}")
            chans[f"{n}/w0"].send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i})
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_beat:
                    for i, n in enumerate(NODES):
                        chans[f"{n}/node"].send(MsgType.HEARTBEAT, {"node": n, "pid": 100 + i})
                    next_beat = time.monotonic() + 0.1
                for who, ch in chans.items():
                    while (got := ch.recv(0.002)) is not None:
                        self.got.append((time.monotonic(), who, got[1].type, got[1].body))
        finally:
            for ch in chans.values():
                ch.close()

    def of(self, who: str, mtype: MsgType, since: float = 0.0) -> list[float]:
        return [t for t, w, m, _ in list(self.got) if w == who and m is mtype and t >= since]


def test_a_node_that_keeps_flooding_is_fenced_and_the_others_keep_their_leases(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys", NODES)
    events = EventLog(tmp_path / "events.jsonl")
    cfg = ControllerConfig(
        settings=JobSettings(heartbeat_timeout_s=1.5, controller_timeout_s=2.0),  # leases every 0.5 s
        tick_s=0.02,
        abuse=AbuseLimits(window_s=3.0, intervals=3, messages=300),  # the defaults, shorter
    )
    ctl = Controller(cfg, ["a", "b"], ["s0"], 1, keys, events)
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    ctx = zmq.Context()
    nodes = _Nodes(ctx, ctl.endpoint, keys)
    flooder = connect(ctx, ctl.endpoint, keys.node("a"), "a/flood")  # a's key: it may speak as a
    try:
        deadline = time.monotonic() + 15.0
        while ctl.view.membership is None or len(nodes.of("s0/node", MsgType.LEASE)) == 0:
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        assert ctl.view.membership.node_ranks.keys() == {"a", "b"}
        body = {"node": "a", "name": "spam", "fields": {"blob": "x" * 200}}
        frame = encode(Message(MsgType.EVENT, "a/flood", 1, time.time() + 3600, body))
        t0 = time.monotonic()
        seq = 1
        # ~3000 a second (200 fit a's budget) until a is fenced, at most 10 s.
        while ctl.view.nodes["a"].role != NodeRole.FENCED and time.monotonic() - t0 < 10.0:
            for _ in range(30):
                seq += 1
                flooder.sock.send(frame.replace(b'"seq":1,', b'"seq":%d,' % seq), copy=False)
            time.sleep(0.01)
        t_fenced = time.monotonic()
        assert ctl.view.nodes["a"].role == NodeRole.FENCED, f"a flooded {t_fenced - t0:.1f}s and was not fenced"
        assert t_fenced - t0 >= 1.0  # sustained (3 intervals touched), not the first drops
        assert "abuse: a stayed over its message budget" in ctl.view.nodes["a"].reason
        time.sleep(1.2)  # the new epoch, and the leases after it
        m = ctl.view.membership
        assert m is not None and m.epoch == 2 and m.node_ranks.keys() == {"b", "s0"}  # a's ranks: the spare's
        named = [e for e in events.records if e["event"] == "node_abusive"]
        assert [(e["node"], e["fenced"]) for e in named] == [("a", True)]
        failures = [e for e in events.records if e["event"] == "failure_detected"]
        assert [(e["node"], e["detector"]) for e in failures] == [("a", "abuse")]
        assert "abuse:" in failures[0]["cause"]
        assert nodes.of("a/node", MsgType.FENCE)  # and it was told
        # The victims: b kept its place, its budget, and its leases throughout.
        assert ctl.view.nodes["b"].role == NodeRole.ACTIVE and ctl.state.dropped.get("b", 0) == 0
        assert not nodes.of("b/node", MsgType.FENCE) and not nodes.of("b/node", MsgType.SHUTDOWN)
        leases = nodes.of("b/node", MsgType.LEASE, t0)
        gaps = [y - x for x, y in zip([t0, *leases], [*leases, time.monotonic()])]
        assert len(leases) >= 3 and max(gaps) < 1.5, gaps
        assert ctl.result is None  # the job goes on
        # Every worker got the job's data key (launcher/worker/transport/mac.py), over CURVE only.
        welcomes = [body for _, w, m, body in list(nodes.got) if w == "b/w0" and m is MsgType.WELCOME]
        assert welcomes and welcomes[0]["data_key"] == data_key(keys, cfg.job_id).hex()
        other = generate_keys(tmp_path / "other", NODES)
        assert len({data_key(keys, "j"), data_key(keys, "k"), data_key(other, "j")}) == 3
        assert data_key(keys, "j") == data_key(KeyDir(keys.path), "j") and len(data_key(keys, "j")) == 32
    finally:
        ctl.result = ctl.result or JobResult(1, "test over")
        th.join(10)
        nodes.stop.set()
        nodes.th.join(5)
        flooder.close()
        ctx.destroy(linger=0)
        events.close()
