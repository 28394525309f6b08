"""One node's key holder floods the controller with large EVENTs: the tick (leases, the
timeout checks) must still run on time, and the flood is dropped over the node's budget."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq

from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.events.log import EventLog
from resild.wire.channel import connect
from resild.wire.protocol import Message, MsgType, encode
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)


def test_an_event_flood_does_not_starve_the_tick_or_the_leases(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    cfg = ControllerConfig(settings=JobSettings(heartbeat_timeout_s=1.5, controller_timeout_s=2.0), tick_s=0.02)
    ctl = Controller(cfg, ["a", "b"], ["s0"], 1, None, events)
    ticks: list[float] = []
    real_tick = ctl._tick

    def tick(now: float) -> None:
        ticks.append(time.monotonic())
        real_tick(now)

    ctl._tick = tick  # type: ignore[method-assign]
    # Leases as the controller sends them: the fake node shares this process (and its GIL,
    # and the flood's I/O) with the flooder, so when it reads them says little.
    sent: list[float] = []
    real_send = ctl.bc.send_leases

    def send_leases(*a: object) -> None:
        sent.append(time.monotonic())
        real_send(*a)  # type: ignore[arg-type]

    ctl.bc.send_leases = send_leases  # type: ignore[method-assign]
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    ctx = zmq.Context()
    try:
        flooder = connect(ctx, ctl.endpoint, None, "a/node")
        victim = connect(ctx, ctl.endpoint, None, "b/node")
        flooder.send(MsgType.REGISTER_NODE, {"node": "a", "pid": 1})
        victim.send(MsgType.REGISTER_NODE, {"node": "b", "pid": 2})
        time.sleep(0.3)
        # One ~1 MB frame, encoded once and sent 300 times: the flood arrives faster than
        # the controller can decode it, as from a node with a fast NIC.
        body = {"node": "a", "name": "spam", "fields": {"blob": "x" * 1_000_000}}
        frame = encode(Message(MsgType.EVENT, "a/flood", 1, time.time() + 3600, body))
        assert frame.count(b'"seq":1,') == 1
        t0 = time.monotonic()
        for seq in range(1, 301):  # each with its own seq: a replay would be refused
            flooder.sock.send(frame.replace(b'"seq":1,', b'"seq":%d,' % seq), copy=False)
        got_leases = 0
        while time.monotonic() - t0 < 4.0:
            got = victim.recv(0.05)
            got_leases += got is not None and got[1].type == MsgType.LEASE
        t_end = time.monotonic()
        seen = [t0, *(t for t in ticks if t0 <= t <= t_end), t_end]
        gaps = [b - a for a, b in zip(seen, seen[1:])]
        assert max(gaps) < 0.5, f"the tick stalled {max(gaps):.2f}s ({len(seen) - 2} ticks in {t_end - t0:.1f}s)"
        leases = [t for t in sent if t0 <= t <= t_end]
        lease_gaps = [b - a for a, b in zip([t0, *leases], leases)]
        assert len(leases) >= 6 and max(lease_gaps) < 0.8, lease_gaps  # every 0.5 s
        assert got_leases >= 4  # and they do arrive
        assert ctl.state.dropped.get("a", 0) > 0  # over its budget: counted, not written
        assert sum(1 for e in events.records if e["event"] == "worker.spam") < 10
    finally:
        ctl.result = JobResult(1, "test over")
        th.join(10)
        ctx.destroy(linger=0)
        events.close()
