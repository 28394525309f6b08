"""A full disk (the events file on /dev/full) must not stop the job: the controller still
decides and finishes, the in-memory records stay bounded."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from resild.controller.loop import Controller, ControllerConfig
from resild.events.log import EventLog
from resild.wire.protocol import PROTOCOL_VERSION, Message, MsgType, decode

pytestmark = pytest.mark.timeout(60)
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full")


def _msg(mtype: MsgType, body: dict[str, Any]) -> Message:
    frame = json.dumps(
        {"v": PROTOCOL_VERSION, "type": mtype.value, "sender": "x", "seq": 1, "deadline": 1e10, "body": body}
    ).encode()
    return decode(frame)


@needs_dev_full
def test_emit_on_a_full_disk_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(DEV_FULL)
    seen: list[dict[str, Any]] = []
    log.listeners.append(seen.append)
    with caplog.at_level("WARNING", logger="resild.events"):
        for i in range(5):
            log.emit("job_started", i=i)
    log.close()
    assert len(seen) == 5 and len(log.records) == 5  # listeners and memory still get them
    assert log.dropped_lines == 5
    assert caplog.text.count("could not write") == 1  # said once, not per line


def test_records_are_bounded_and_failures_outlive_a_flood() -> None:
    log = EventLog(None, max_records=100, max_other_records=50)
    log.emit("failure_detected", node="a", cause="x", detector="hang")
    for i in range(1000):
        log.emit("worker.chatter", i=i)
    for i in range(200):
        log.emit("reform", epoch=i, reason="r")
    assert len(log.records) <= 150
    assert log.records[0]["event"] == "failure_detected"  # a flood of peer events cannot push it out
    assert log.records_dropped > 0


@needs_dev_full
def test_a_controller_whose_events_file_is_full_still_decides_and_finishes() -> None:
    ctx = zmq.Context()
    ctl = Controller(ControllerConfig(), ["n0", "n1"], ["n2"], 1, None, EventLog(DEV_FULL), ctx=ctx)
    try:
        now = time.monotonic()
        for i, n in enumerate(["n0", "n1", "n2"]):
            ctl._handle(f"{n}/node".encode(), _msg(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i}), now)
            ctl._handle(
                f"{n}/w0/1".encode(), _msg(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i}), now
            )
        assert ctl.view.membership is not None  # the first epoch, announced despite the disk
        ctl._handle(
            b"n0/node", _msg(MsgType.WORKER_EXIT, {"node": "n0", "local_rank": 0, "pid": 200, "returncode": 1}), now
        )
        m = ctl.view.membership
        assert m is not None and "n2" in m.node_ranks and "n0" not in m.node_ranks  # replaced
        for rank in range(m.world_size):
            ctl._handle(b"x/node", _msg(MsgType.DONE, {"node": m.node_of(rank), "rank": rank, "epoch": m.epoch}), now)
        assert ctl.result is not None and ctl.result.exit_code == 0
        assert ctl.events.dropped_lines > 0
    finally:
        ctl.server.close()
        ctl.events.close()
        ctx.destroy(linger=0)
