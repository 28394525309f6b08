"""A node's key holder connects first with another node's routing id (finding 5): the
ROUTER ignores a later peer with a routing id in use, so that node used to be locked out
of its own job. Now routing ids are unguessable (`<sender>#<nonce>`), the squatter's
messages are refused and the event names its key, and the victim registers as usual."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.events.log import EventLog
from resild.wire.channel import Channel, _set_curve_client, connect, limit_frame_size
from resild.wire.keys import KeyDir, generate_keys
from resild.wire.protocol import MsgType
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def _controller(tmp_path: Path, settings: JobSettings) -> Iterator[tuple[Controller, EventLog, Any, list[Channel]]]:
    """A controller for nodes a and b (spare s0), keys made, on its thread; the sockets a test
    puts in the list are closed after it."""
    keys = generate_keys(tmp_path / "keys", ["a", "b", "s0"])
    events = EventLog(tmp_path / "events.jsonl")
    ctl = Controller(ControllerConfig(settings=settings, tick_s=0.02), ["a", "b"], ["s0"], 1, keys, events)
    th = threading.Thread(target=ctl.run, daemon=True)
    th.start()
    ctx = zmq.Context()
    sockets: list[Channel] = []
    try:
        yield ctl, events, ctx, sockets
    finally:
        ctl.result = JobResult(1, "test over")
        th.join(10)
        for c in sockets:
            c.close()
        ctx.destroy(linger=0)
        events.close()


def _raw(ctx: Any, endpoint: str, identity: bytes, key_dir: Any, sender: str) -> Channel:
    """A DEALER with the routing id it is given (not an unguessable one) and a node's key."""
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    limit_frame_size(raw)
    raw.setsockopt(zmq.IDENTITY, identity)
    _set_curve_client(raw, key_dir)
    raw.connect(endpoint)
    return Channel(raw, sender, router=False)


def test_a_key_holder_squatting_on_another_nodes_routing_id_does_not_lock_it_out(tmp_path: Path) -> None:
    with _controller(tmp_path, JobSettings()) as (ctl, events, ctx, sockets):
        keys = KeyDir(tmp_path / "keys")
        # Node a's key, node b's routing id, connected before b.
        squatter = _raw(ctx, ctl.endpoint, b"b/node", keys.node("a"), "b/node")
        sockets.append(squatter)
        squatter.send(MsgType.HEARTBEAT, {"node": "b", "pid": 666})
        err = squatter.recv(5.0)  # refused: and now it holds the routing id b/node
        assert err is not None and err[1].type is MsgType.ERROR and err[1].body["code"] == "identity"
        assert "b" not in ctl.node_ident

        victim = connect(ctx, ctl.endpoint, keys.node("b"), "b/node")
        sockets.append(victim)
        victim.send(MsgType.REGISTER_NODE, {"node": "b", "pid": 2})
        lease = None
        deadline = time.monotonic() + 5.0
        while lease is None and time.monotonic() < deadline:
            got = victim.recv(0.1)
            if got is not None and got[1].type is MsgType.LEASE:
                lease = got
        assert ctl.view.nodes["b"].registered, "node b was locked out by a's key holding its routing id"
        assert lease is not None, "node b never heard from the controller"
        assert ctl.node_ident["b"] != b"b/node"  # the controller answers b's own connection
        victim.send(MsgType.HEARTBEAT, {"node": "b", "pid": 2})
        squatter.send(MsgType.HEARTBEAT, {"node": "b", "pid": 666})
        time.sleep(0.3)
        assert ctl.view.nodes["b"].host_pid == 2
        refused = [e for e in events.records if e["event"] == "peer_refused"]
        assert refused and refused[0]["key"] == "a", refused  # named: the key that did it
        assert refused[0]["routing_id"] == "b/node"
        assert len(refused) == 1  # then counted, not one event per frame
        assert ctl.view.nodes["a"].role.value == "active"  # refused, not fenced: a wrong frame is no failure
