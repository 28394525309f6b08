"""A controller never shuts a healthy job down because of its own error: an exception in a
message handler or in the tick is reported (log, `controller_error` event, journal) and
the job goes on; a tick failing on every round, or the loop itself failing, stops the
controller (ControllerFailed) without a SHUTDOWN to anyone. SHUTDOWN comes with a verdict."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

import resild.controller.loop as loop
from resild.controller import policy
from resild.controller.backend import Backend
from resild.controller.journal import Journal
from resild.controller.loop import Controller, ControllerConfig, ControllerFailed, JobResult
from resild.events.log import EventLog
from resild.wire.channel import Channel, connect
from resild.wire.protocol import MsgType
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)

NODES = ["a", "b"]


class _Backend(Backend):
    def __init__(self) -> None:
        self.shutdowns: list[float] = []

    def shutdown(self, timeout_s: float) -> None:
        self.shutdowns.append(timeout_s)


class _Nodes:
    """Each node's process and its one worker, on a thread: they register, heartbeat every
    0.1 s and keep every message they get as (time, sender, type, body)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self.got: list[tuple[float, str, MsgType, dict[str, Any]]] = []
        self.outbox: list[tuple[str, MsgType, dict[str, Any]]] = []
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        chans: dict[str, Channel] = {}
        for i, n in enumerate(NODES):
            chans[f"{n}/node"] = connect(self.ctx, self.endpoint, None, f"{n}/node")
            chans[f"{n}/node"].send(MsgType.REGISTER_NODE, {"node": n, "pid": 100 + i})
            chans[f"{n}/w0"] = connect(self.ctx, self.endpoint, None, f"{n}/w0/{200 + i}")
            chans[f"{n}/w0"].send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": 0, "pid": 200 + i})
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                if time.monotonic() >= next_beat:
                    for i, n in enumerate(NODES):
                        chans[f"{n}/node"].send(MsgType.HEARTBEAT, {"node": n, "pid": 100 + i})
                    next_beat = time.monotonic() + 0.1
                while self.outbox:
                    who, mtype, body = self.outbox.pop(0)
                    chans[who].send(mtype, body)
                for who, ch in chans.items():
                    while (got := ch.recv(0.002)) is not None:
                        self.got.append((time.monotonic(), who, got[1].type, got[1].body))
        finally:
            for ch in chans.values():
                ch.close()

    def of(self, mtype: MsgType, since: float = 0.0) -> list[tuple[float, str, MsgType, dict[str, Any]]]:
        return [g for g in list(self.got) if g[2] is mtype and g[0] >= since]


def _start(tmp_path: Path, **cfg: Any) -> tuple[Controller, _Backend, EventLog, dict[str, Any], threading.Thread]:
    events = EventLog(tmp_path / "events.jsonl")
    backend = _Backend()
    settings = JobSettings(heartbeat_timeout_s=1.5, controller_timeout_s=2.0)  # leases every 0.5 s
    ctl = Controller(
        ControllerConfig(settings=settings, tick_s=0.02, **cfg),
        NODES,
        [],
        1,
        None,
        events,
        Journal(tmp_path / "journal.jsonl"),
        backend,
    )
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = ctl.run()
        except BaseException as e:  # the test reads it
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return ctl, backend, events, out, th


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _journal(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines() if line]


def test_a_handler_or_tick_error_is_reported_and_the_job_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, backend, events, out, th = _start(tmp_path)
    ctx = zmq.Context()
    nodes = _Nodes(ctx, ctl.endpoint)
    try:
        _wait(lambda: ctl.view.membership is not None)  # every worker registered: epoch 1

        def bad_handler(*a: object) -> None:
            raise RuntimeError("injected handler bug")

        monkeypatch.setitem(ctl.handlers._handlers, MsgType.EVENT, bad_handler)
        real_checks = policy.check_timeouts
        failing = {"left": 40}  # ~0.8 s of failing ticks

        def bad_checks(*a: Any) -> Any:
            if failing["left"] > 0:
                failing["left"] -= 1
                raise RuntimeError("injected tick bug")
            return real_checks(*a)

        monkeypatch.setattr(loop, "check_timeouts", bad_checks)
        t_armed = time.monotonic()
        nodes.outbox.append(("a/node", MsgType.EVENT, {"node": "a", "name": "hello", "fields": {}}))
        _wait(lambda: failing["left"] == 0)
        time.sleep(1.0)  # and the job goes on after it
        assert "error" not in out and ctl.result is None and th.is_alive()
        assert not nodes.of(MsgType.SHUTDOWN), "a node was told to shut down over the controller's own error"
        assert backend.shutdowns == []
        errs = nodes.of(MsgType.ERROR)
        assert [e[3]["code"] for e in errs] == ["internal"] and errs[0][1] == "a/node"  # the message: answered
        leases = [t for t, who, _, _ in nodes.of(MsgType.LEASE, t_armed) if who == "b/node"]
        assert len(leases) >= 3, leases  # the leases went on while the checks failed
        recs = [e for e in events.records if e["event"] == "controller_error"]
        assert {e["where"] for e in recs} == {"handler:event", "tick:checks"}, recs
        assert len(recs) == 2  # one report per place per 10 s, not one per tick
        by_where = {e["where"]: e for e in recs}
        assert "injected tick bug" in by_where["tick:checks"]["traceback"]
        assert by_where["handler:event"]["sender"] == "a/node" and not any(e["fatal"] for e in recs)
        assert {r["where"] for r in _journal(tmp_path) if r["action"] == "controller_error"} == {
            "handler:event",
            "tick:checks",
        }
        assert all(v.role.value == "active" for v in ctl.view.nodes.values())
        # The verdict, and only it, sends SHUTDOWN.
        ctl.result = JobResult(0, "test over")
        th.join(10)
        _wait(lambda: len({who for _, who, _, _ in nodes.of(MsgType.SHUTDOWN)}) >= 2)
        assert backend.shutdowns
    finally:
        ctl.result = ctl.result or JobResult(1, "test over")
        th.join(10)
        nodes.stop.set()
        nodes.th.join(5)
        ctx.destroy(linger=0)
        events.close()


@pytest.mark.parametrize("where", ["tick", "loop"])
def test_a_controller_that_keeps_failing_stops_without_a_shutdown(tmp_path: Path, where: str) -> None:
    ctl, backend, events, out, th = _start(tmp_path, tick_error_limit_s=0.5)
    ctx = zmq.Context()
    nodes = _Nodes(ctx, ctl.endpoint)
    try:
        _wait(lambda: ctl.view.membership is not None)

        def boom(*a: object) -> bool:
            raise RuntimeError(f"injected {where} bug")

        t0 = time.monotonic()
        if where == "tick":
            ctl._tick = boom  # type: ignore[method-assign,assignment]
        else:
            ctl.leadership = boom  # the loop's own machinery
        th.join(10)
        assert not th.is_alive()
        assert isinstance(out.get("error"), ControllerFailed), out
        if where == "tick":
            assert time.monotonic() - t0 >= 0.5  # not at the first error
        time.sleep(0.5)
        assert not nodes.of(MsgType.SHUTDOWN), "the controller's own failure told the nodes to shut down"
        assert backend.shutdowns == []  # nor was the job's backend shut down
        assert ctl.result is None  # no verdict
        fatal = [e for e in events.records if e["event"] == "controller_error" and e["fatal"]]
        assert len(fatal) == 1 and fatal[0]["where"] == where
        assert any(r["action"] == "controller_error" and r["fatal"] for r in _journal(tmp_path))
    finally:
        ctl.result = ctl.result or JobResult(1, "test over")
        th.join(10)
        nodes.stop.set()
        nodes.th.join(5)
        ctx.destroy(linger=0)
        events.close()


def test_an_error_of_ours_in_reading_a_message_drops_it_and_a_broken_socket_stops_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    ctl = Controller(ControllerConfig(), NODES, [], 1, None, events)
    try:

        def bad_recv(timeout_s: float) -> None:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a frame we did not expect")

        monkeypatch.setattr(ctl.ch, "recv", bad_recv)
        assert ctl._recv(0.0) is None
        assert [e["where"] for e in events.records if e["event"] == "controller_error"] == ["recv"]

        def broken(timeout_s: float) -> None:
            raise zmq.ZMQError(zmq.ETERM)

        monkeypatch.setattr(ctl.ch, "recv", broken)
        with pytest.raises(zmq.ZMQError):
            ctl._recv(0.0)
    finally:
        ctl.server.close()
        events.close()
