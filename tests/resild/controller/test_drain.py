"""Which fences drain the node in the scheduler: only those with evidence against the node,
or a second strike (late evidence against a node fenced on suspicion)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import zmq

from resild.controller.backend import Backend
from resild.controller.loop import Controller, ControllerConfig
from resild.events.log import EventLog
from resild.wire.protocol import PROTOCOL_VERSION, Message, MsgType, decode

pytestmark = pytest.mark.timeout(60)


class Recording(Backend):
    def __init__(self) -> None:
        self.drains: list[tuple[str, str]] = []
        self.fences: list[str] = []

    def fence(self, node: str, reason: str) -> None:
        self.fences.append(node)

    def drain(self, node: str, reason: str) -> None:
        self.drains.append((node, reason))


def _msg(mtype: MsgType, body: dict[str, Any]) -> Message:
    frame = json.dumps(
        {"v": PROTOCOL_VERSION, "type": mtype.value, "sender": "x", "seq": 1, "deadline": 1e10, "body": body}
    ).encode()
    return decode(frame)


@pytest.fixture
def ctl():
    ctx = zmq.Context()
    backend = Recording()
    c = Controller(ControllerConfig(), ["n0", "n1"], ["n2", "n3"], 1, None, EventLog(None), backend=backend, ctx=ctx)
    now = time.monotonic()
    for i, n in enumerate(["n0", "n1", "n2", "n3"]):
        c._handle(f"{n}/node".encode(), _msg(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i}), now)
        c._handle(
            f"{n}/w0/1".encode(), _msg(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i}), now
        )
    assert c.view.membership is not None
    try:
        yield c, backend
    finally:
        c.server.close()
        ctx.destroy(linger=0)


def test_a_worker_exception_replaces_but_does_not_drain(ctl) -> None:
    c, backend = ctl
    now = time.monotonic()
    c._handle(
        b"n0/w0/1", _msg(MsgType.FAILED, {"node": "n0", "local_rank": 0, "pid": 200, "error": "KeyError: x"}), now
    )
    m = c.view.membership
    assert m is not None and "n0" not in m.node_ranks  # its ranks went to a spare, as before
    assert backend.fences == ["n0"] and backend.drains == []
    suspect = [e for e in c.events.records if e["event"] == "node_suspect"]
    assert len(suspect) == 1 and suspect[0]["node"] == "n0" and "KeyError" in suspect[0]["reason"]
    # The second strike: the node's daemon now finds its GPU failed: drained.
    c._handle(b"n0/agent", _msg(MsgType.HEALTH, {"node": "n0", "verdict": "failed", "reasons": ["Xid 79"]}), now + 1)
    assert [n for n, _ in backend.drains] == ["n0"] and "Xid 79" in backend.drains[0][1]


def test_evidence_against_the_node_drains_it(ctl) -> None:
    c, backend = ctl
    now = time.monotonic()
    c._handle(b"n1/agent", _msg(MsgType.HEALTH, {"node": "n1", "verdict": "failed", "reasons": ["ECC"]}), now)
    assert [n for n, _ in backend.drains] == ["n1"]
    assert not [e for e in c.events.records if e["event"] == "node_suspect"]
