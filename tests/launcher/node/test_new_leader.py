"""What a node process tells a new leader: found by the system soak, an Xid 79 verdict
sent to a leader killed a moment later never reached its successor, and the job
trained on with the failed GPU."""

from __future__ import annotations

from typing import Any

from launcher.node.process import NodeProcess
from resild.wire.protocol import MsgType


class FakeControllers:
    leader_endpoint = "tcp://127.0.0.1:1"
    leader = 0

    def __init__(self) -> None:
        self.sent: list[tuple[MsgType, dict[str, Any]]] = []

    def send(self, mtype: MsgType, body: dict[str, Any], ttl_s: float | None = None) -> None:
        self.sent.append((mtype, body))

    def send_all(self, mtype: MsgType, body: dict[str, Any], ttl_s: float | None = None) -> None:
        self.sent.append((mtype, body))

    def send_standbys(self, mtype: MsgType, body: dict[str, Any], ttl_s: float | None = None) -> None:
        pass


class Layout:
    epoch = 1


def node_process() -> NodeProcess:
    p = object.__new__(NodeProcess)  # only what _new_leader reads: no sockets, no workers
    p.node, p.nproc, p.layout, p.relay = "n0", 1, Layout(), None
    p.exited, p.health, p._relayed_sent = [], None, None
    p._report_s, p._epoch_sent, p.heartbeat_s = -1e9, -1, 0.25
    p.ch = FakeControllers()  # type: ignore[assignment]
    return p


def test_a_new_leader_hears_a_failed_health_verdict_again() -> None:
    p = node_process()
    failed = {"verdict": "failed", "reasons": ["gpu0: Xid 79"], "detector": "nvml-xid"}
    p._send_health(failed)
    p.ch.sent.clear()  # type: ignore[attr-defined]
    p._new_leader({"term": 6, "pid": 2, "host": "h"})
    health = [b for t, b in p.ch.sent if t == MsgType.HEALTH]  # type: ignore[attr-defined]
    assert health == [{"node": "n0", **failed}]


def test_a_healthy_node_sends_no_verdict_to_a_new_leader() -> None:
    p = node_process()
    p._send_health({"verdict": "healthy", "reasons": [], "detector": "nvml"})
    p.ch.sent.clear()  # type: ignore[attr-defined]
    p._new_leader({"term": 6})
    assert not [t for t, _ in p.ch.sent if t == MsgType.HEALTH]  # type: ignore[attr-defined]
