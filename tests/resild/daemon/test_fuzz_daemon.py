"""Fuzzing the node daemon's local socket handler: any frame from any peer gets one
bounded, decodable reply; a non-root peer never gets another user's process watched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resild.daemon.agent import Agent
from resild.health.config import Config
from resild.wire.local_socket import Peer
from resild.wire.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, MsgType, ProtocolError, decode
from tests.resild.daemon.test_daemon import Flip
from tests.resild.wire.test_fuzz_protocol import bodies, json_values

pytestmark = pytest.mark.timeout(180)
ROOT, USER = Peer(pid=1, uid=0, gid=0), Peer(pid=12345, uid=65534, gid=65534)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzd")
    ctx = zmq.Context()
    a = Agent(Config(node="n1", state_dir=str(d), status_socket=str(d / "s.sock")), probes=[Flip()], ctx=ctx)
    a._check_once()
    yield a
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a root-owned process
    yield p
    p.kill()
    p.wait()


def _reply(agent: Agent, frame: bytes, peer: Peer):
    out = agent._handle_local(frame, peer)
    assert isinstance(out, bytes) and len(out) <= MAX_FRAME_BYTES
    msg = decode(out)  # always a well-formed reply
    assert msg.type in (MsgType.STATUS_REPLY, MsgType.ERROR)
    return msg


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=2048))
def test_any_bytes(agent: Agent, frame: bytes) -> None:
    _reply(agent, frame, USER)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    mtype=st.sampled_from(list(MsgType)),
    body=bodies,
    pid=st.sampled_from(["self", "root", 1, 0, -1, None]) | json_values,
    root=st.booleans(),
)
def test_any_body_any_peer(agent: Agent, sleeper, mtype: MsgType, body: dict, pid, root: bool) -> None:
    if pid == "self":
        pid = os.getpid()
    elif pid == "root":
        pid = sleeper.pid
    if pid is not None:
        body = {**body, "pid": pid}
    frame = json.dumps(
        {"v": PROTOCOL_VERSION, "type": mtype.value, "sender": "x", "seq": 1, "deadline": 1e10, "body": body},
        allow_nan=True,
    ).encode()
    try:
        decode(frame)
    except ProtocolError:
        pass
    peer = ROOT if root else USER
    msg = _reply(agent, frame, peer)
    if not root and mtype in (MsgType.REGISTER_WORKER, MsgType.PROGRESS):
        # nobody (uid 65534) owns none of these processes: never accepted for it
        assert msg.type is MsgType.ERROR
    with agent._lock:
        assert all(w.uid == 0 or w.pid not in (1, sleeper.pid) for w in agent.procs.values())
        assert all(len(w.name) <= 128 and w.name.isprintable() for w in agent.procs.values())
