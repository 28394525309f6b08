"""Fuzzing the controller: every message type with arbitrary bodies, decoded the way the
wire decodes them, against an in-process controller's handlers. No body that decode
accepts may make a handler raise, and the end-of-run table must still be computable."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.run.status import format_table, summarize
from resild.controller.loop import Controller, ControllerConfig
from resild.events.log import EventLog
from resild.wire.protocol import PROTOCOL_VERSION, Message, MsgType, ProtocolError, decode
from tests.resild.wire.test_fuzz_protocol import bodies

pytestmark = pytest.mark.timeout(180)
NODES = ["n0", "n1", "n2"]
PEER_TYPES = [
    MsgType.REGISTER_NODE,
    MsgType.HEARTBEAT,
    MsgType.WORKER_EXIT,
    MsgType.HEALTH,
    MsgType.REGISTER_WORKER,
    MsgType.PROGRESS,
    MsgType.EVENT,
    MsgType.DONE,
    MsgType.FAILED,
    MsgType.FATAL,
    MsgType.STATUS,
    MsgType.PING,
    MsgType.ERROR,
]


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _controller(ctx: zmq.Context) -> Controller:
    ctl = Controller(ControllerConfig(), ["n0", "n1"], ["n2"], 1, None, EventLog(None), ctx=ctx)
    # A running job: registered nodes and workers, the first epoch announced.
    now = time.monotonic()
    for i, n in enumerate(NODES):
        ctl._handle(f"{n}/node".encode(), _msg(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i}), now)
        ctl._handle(
            f"{n}/w0/1".encode(), _msg(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i}), now
        )
    assert ctl.view.membership is not None
    return ctl


def _msg(mtype: MsgType, body: dict[str, Any]) -> Message:
    frame = json.dumps(
        {"v": PROTOCOL_VERSION, "type": mtype.value, "sender": "x", "seq": 1, "deadline": 1e10, "body": body},
        allow_nan=True,
    ).encode()
    return decode(frame)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    msgs=st.lists(
        st.tuples(
            st.sampled_from(PEER_TYPES),
            st.sampled_from(NODES + ["zz", ""]),
            st.sampled_from(["/node", "/w0/1", "/agent"]),
            bodies,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_no_accepted_body_breaks_a_handler(ctx, msgs) -> None:
    ctl = _controller(ctx)
    try:
        for mtype, node, suffix, body in msgs:
            if node:
                body = {**body, "node": node}
            try:
                msg = _msg(mtype, body)
            except ProtocolError:
                continue
            ctl._handle(f"{node}{suffix}".encode(), msg, time.monotonic())  # must not raise
            ctl._tick(time.monotonic())
        failures, job = summarize(ctl.events.records)  # the end-of-run table survives anything
        format_table(failures, job)
        json.dumps(ctl.status())
    finally:
        ctl.server.close()


def test_a_worker_event_cannot_break_the_end_of_run_table(ctx) -> None:
    """A worker EVENT named failure_detected without `cause` broke the table."""
    ctl = _controller(ctx)
    try:
        ctl._handle(
            b"n0/w0/1", _msg(MsgType.EVENT, {"node": "n0", "name": "failure_detected", "fields": {}}), time.monotonic()
        )
        assert ctl.events.records[-1]["event"] == "worker.failure_detected"
        failures, job = summarize(ctl.events.records)
        assert failures == [] and "no failures" in format_table(failures, job)
    finally:
        ctl.server.close()


def test_the_loop_survives_a_handler_that_raises(ctx, monkeypatch, caplog) -> None:
    ctl = _controller(ctx)
    try:

        def boom(*_: Any) -> None:
            raise OverflowError("cannot convert float infinity to integer")

        monkeypatch.setattr(ctl, "_handle", boom)
        ctl._dispatch(
            b"n0/w0/1", _msg(MsgType.PROGRESS, {"node": "n0", "rank": 0, "epoch": 1, "step": 1}), time.monotonic()
        )
        assert "controller error in handler:progress" in caplog.text and "sender='x'" in caplog.text
        assert ctl.result is None
    finally:
        ctl.server.close()
