"""Framing, versioning, typed bodies and authentication over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import zmq

from resild.wire.channel import Server, connect, peer_name
from resild.wire.keys import ADMIN, KeyDir, generate_keys
from resild.wire.protocol import (
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Event,
    Heartbeat,
    Message,
    MsgType,
    Progress,
    ProtocolError,
    Sequencer,
    decode,
    encode,
)
from tests.tcp_proxy import CuttableProxy

pytestmark = pytest.mark.timeout(60)


def _frame(mtype: str = "heartbeat", body: object = None, **env: object) -> bytes:
    raw = {"v": PROTOCOL_VERSION, "type": mtype, "sender": "x", "seq": 1, "deadline": 1e10, **env}
    if body is not None:
        raw["body"] = body
    return json.dumps(raw).encode()


def test_round_trip() -> None:
    m = Message(MsgType.HEARTBEAT, "n1/node", 7, time.time() + 5, {"node": "n1"})
    assert decode(encode(m)) == m


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"\xff\xfe", "malformed"),
        (b"[1,2]", "malformed"),
        (json.dumps({"v": 99, "type": "heartbeat", "sender": "x", "seq": 1, "deadline": 1}).encode(), "bad_version"),
        (
            json.dumps({"v": PROTOCOL_VERSION, "type": "nope", "sender": "x", "seq": 1, "deadline": 1}).encode(),
            "bad_type",
        ),
        (
            json.dumps({"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "", "seq": 1, "deadline": 1}).encode(),
            "malformed",
        ),
        (
            json.dumps({"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "x", "seq": -1, "deadline": 1}).encode(),
            "malformed",
        ),
        (
            json.dumps(
                {"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "x", "seq": 1, "deadline": 1, "body": []}
            ).encode(),
            "malformed",
        ),
        (b"x" * (2 << 20), "too_large"),
        # Non-finite numbers never get in (a NaN/infinite deadline never expires; an infinite
        # rank crashed the controller with OverflowError).
        (_frame("progress", {"node": "n", "rank": float("inf"), "epoch": 1, "step": 1}), "malformed"),
        (_frame(deadline=float("nan")), "malformed"),
        (_frame(deadline=float("inf")), "malformed"),
        (_frame().replace(b'"deadline": 10000000000.0', b'"deadline": 1e400'), "malformed"),
        (_frame(seq=1 << 60), "malformed"),
        (_frame(v=True), "bad_version"),
        (_frame(type=["heartbeat"]), "bad_type"),
        (_frame(sender="s" * 300), "malformed"),
        (_frame(body={"a": json.loads("[" * 20 + "1" + "]" * 20)}), "malformed"),
        (_frame(body={"x": 1 << 70}), "malformed"),
        # 1e999 parses as inf: refused wherever it sits, a key no body type reads included
        (_frame(body={"extra": [0.5]}).replace(b"0.5", b"1e999"), "malformed"),
        (_frame(body={"extra": {"deep": 0.5}}).replace(b"0.5", b"-1e999"), "malformed"),
        (_frame().replace(b'"heartbeat"', b'"h\xffeartbeat"'), "malformed"),  # not UTF-8
        (_frame().replace(b'"heartbeat"', '"h\u00e9artbeat"'.encode()), "bad_type"),
        # Typed bodies: ranges, types and lengths checked once, here.
        (_frame("progress", {"node": "n", "rank": -1, "epoch": 1, "step": 1}), "bad_body"),
        (_frame("progress", {"node": "n", "rank": "0", "epoch": 1, "step": 1}), "bad_body"),
        (_frame("progress", {"node": "n", "rank": True, "epoch": 1, "step": 1}), "bad_body"),
        (_frame("done", {"node": "n", "epoch": 1}), "bad_body"),
        (_frame("health", {"node": "n", "verdict": "fine"}), "bad_body"),
        (_frame("health", {"node": "n", "verdict": "failed", "reasons": "all of them"}), "bad_body"),
        (_frame("register_worker", {"pid": 5, "name": "n" * 600_000}), "bad_body"),
        (_frame("heartbeat", {"node": 7}), "bad_body"),
        (_frame("event", {"node": "n", "name": "x y"}), "bad_body"),
        (_frame("event", {"node": "n", "name": "resumed", "fields": {"epoch": 2}}), "bad_body"),
        (
            _frame("event", {"node": "n", "name": "state_replayed", "fields": {"bytes": "many", "seconds": 1}}),
            "bad_body",
        ),
        (_frame("event", {"node": "n", "name": "x", "fields": {"node": "other"}}), "bad_body"),
        (_frame("event", {"node": "n", "name": "x", "fields": {"t_mono": "soon"}}), "bad_body"),
        (_frame("membership", {"epoch": 2, "world_size": 2, "node_ranks": {"a": [0, 5]}}), "bad_body"),
        # A node's aggregated commits: {rank: step}, ranks decimal strings, steps integers
        # in range ({"0": 1e300} got in and reached the handler's int()).
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"0": 1e300}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"0": 1.5}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"0": -1}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"0": True}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"x": 1}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"-1": 1}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": {"99999999999": 1}}), "bad_body"),
        (_frame("progress", {"node": "n", "epoch": 1, "commits": [1, 2]}), "bad_body"),
        (_frame("heartbeat", {"node": "n", "epoch": "1"}), "bad_body"),
        (_frame("heartbeat", {"node": "n", "relayed": [0, "1"]}), "bad_body"),
        (_frame("heartbeat", {"node": "n", "relayed": [-1]}), "bad_body"),
        (_frame("heartbeat", {"node": "n", "resync": 1}), "bad_body"),
        (_frame("register_node", {"node": "n", "relayed": 3}), "bad_body"),
        (_frame("welcome", {"role": "boss"}), "bad_body"),
    ],
)
def test_decode_rejects(frame: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.code == code


def test_the_nesting_limit_is_exact() -> None:
    # MAX_DEPTH containers deep is the most a body may nest: one more is refused
    ok = decode(_frame(body={"a": json.loads("[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1))}))
    assert ok.body["a"]
    with pytest.raises(ProtocolError) as e:
        decode(_frame(body={"a": json.loads("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH)}))
    assert e.value.code == "malformed"


def test_typed_body_alongside_the_dict() -> None:
    m = decode(_frame("progress", {"node": "n", "rank": 3, "epoch": 2, "step": 9, "state": "commit", "extra": [1]}))
    assert m.typed == Progress(node="n", rank=3, epoch=2, step=9, state="commit")
    assert m.body["extra"] == [1]  # unknown keys pass through for handlers that know them


def test_commits_and_relay_state_are_typed() -> None:
    m = decode(_frame("progress", {"node": "n", "epoch": 2, "state": "commit", "commits": {"0": 5, "17": 6}}))
    assert m.typed == Progress(node="n", epoch=2, state="commit", commits={0: 5, 17: 6})
    assert m.body["commits"] == {"0": 5, "17": 6}  # the dict stays as it came
    m = decode(_frame("heartbeat", {"node": "n", "epoch": 3, "pid": 9, "relayed": [0, 1], "resync": True}))
    assert m.typed == Heartbeat(node="n", epoch=3, pid=9, relayed=[0, 1], resync=True)


def test_worker_events_live_in_their_own_namespace() -> None:
    """A worker EVENT named like a controller event must not impersonate it (it broke the
    end-of-run table); the runtime's recovery milestones keep their names."""
    m = decode(_frame("event", {"node": "n", "name": "failure_detected", "fields": {"rank": 0}}))
    assert m.body["name"] == "worker.failure_detected" and isinstance(m.typed, Event)
    m = decode(_frame("event", {"node": "n", "name": "resumed", "fields": {"step": 3, "seconds": 0.1}}))
    assert m.body["name"] == "resumed"


def test_sequence_starts_above_a_previous_incarnation() -> None:
    a = Sequencer("n/node").make(MsgType.HEARTBEAT)
    b = Sequencer("n/node").make(MsgType.HEARTBEAT)  # the same sender, restarted
    assert b.seq > a.seq


@pytest.fixture
def keys(tmp_path: Path) -> KeyDir:
    k = generate_keys(tmp_path / "keys", nodes=["c1", "good", "n1", "n2"])
    assert (k.path / "client.key_secret").stat().st_mode & 0o777 == 0o600
    return k


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _serve_once(server: Server, timeout_s: float = 2.0):
    got = server.channel.recv(timeout_s)
    if got is not None:
        ident, msg = got
        server.channel.send(MsgType.STATUS_REPLY, {"echo": msg.seq}, to=ident)
    return got


def test_a_node_gets_only_its_own_secret(keys: KeyDir) -> None:
    n1 = keys.node("n1")
    assert sorted(p.name for p in n1.path.iterdir()) == ["client.key", "client.key_secret", "server.key"]
    assert n1.path.stat().st_mode & 0o777 == 0o700
    assert (n1.path / "client.key_secret").stat().st_mode & 0o777 == 0o600
    assert n1.server_public() == keys.server_public()
    assert n1.client()[0] != keys.node("n2").client()[0] != keys.client()[0]
    assert sorted(p.stem for p in keys.authorized.iterdir()) == sorted([ADMIN, "c1", "good", "n1", "n2"])


def test_bad_frames_get_an_error_reply_and_the_server_keeps_serving(keys: KeyDir, ctx, caplog) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    client = connect(ctx, server.endpoint, keys.node("c1"), "c1")
    try:
        caplog.set_level(logging.WARNING)
        client.sock.send(b"not json at all")
        client.sock.send(
            json.dumps({"v": 42, "type": "heartbeat", "sender": "c1", "seq": 1, "deadline": 1e12}).encode()
        )
        client.sock.send_multipart([b"two", b"frames"])
        assert server.channel.recv(2.0) is None and server.channel.recv(2.0) is None
        assert server.channel.recv(2.0) is None
        errs = [client.recv(2.0) for _ in range(3)]
        assert [e[1].body["code"] for e in errs] == ["malformed", "bad_version", "malformed"]
        assert server.channel.rejected == 3 and "rejected frame" in caplog.text
        client.send(MsgType.STATUS, {})
        assert _serve_once(server) is not None
        reply = client.recv(2.0)
        assert reply is not None and reply[1].type == MsgType.STATUS_REPLY
    finally:
        client.close()
        server.close()


def test_expired_messages_are_dropped(keys: KeyDir, ctx) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    client = connect(ctx, server.endpoint, keys.node("c1"), "c1")
    try:
        client.send(MsgType.HEARTBEAT, {}, ttl_s=-1.0)
        assert server.channel.recv(1.0) is None and server.channel.rejected == 1
    finally:
        client.close()
        server.close()


def test_unauthenticated_peer_is_rejected_and_logged(keys: KeyDir, ctx, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="resild.auth")
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    stranger_keys = generate_keys(tmp_path / "stranger")  # a valid key pair the server never authorized
    # It knows the server's public key (no secret), but its client key is not in authorized/.
    (stranger_keys.path / "server.key").write_bytes((keys.path / "server.key").read_bytes())
    stranger = connect(ctx, server.endpoint, stranger_keys, "stranger")
    plain = ctx.socket(zmq.DEALER)  # no CURVE at all
    plain.connect(server.endpoint)
    good = connect(ctx, server.endpoint, keys.node("good"), "good")
    try:
        stranger.send(MsgType.HEARTBEAT, {"node": "x"})
        plain.send(b"hello")
        good.send(MsgType.HEARTBEAT, {"node": "good"})
        got = _serve_once(server)
        assert got is not None and got[1].sender == "good"
        assert server.channel.recv(0.5) is None  # nothing from the stranger or the plain socket got through
        assert good.recv(2.0) is not None
        assert stranger.recv(0.3) is None
        assert "DENIED" in caplog.text.upper() or "denied" in caplog.text
    finally:
        for s in (stranger, good):
            s.close()
        plain.close(linger=0)
        server.close()


def test_identity_comes_from_the_key_not_the_body(keys: KeyDir, ctx, caplog) -> None:
    """A key holder cannot speak for another node: not in the body, not as sender, not
    as routing id (it sent HEALTH "failed" for another node and got it fenced)."""
    caplog.set_level(logging.WARNING)
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    n1 = connect(ctx, server.endpoint, keys.node("n1"), "n1/node")
    as_n2 = connect(ctx, server.endpoint, keys.node("n1"), "n2/node")  # n1's key, n2's name
    admin = connect(ctx, server.endpoint, keys, "cli-1")  # the operator key
    try:
        n1.send(MsgType.HEALTH, {"node": "n2", "verdict": "failed", "reasons": ["forged"]})
        as_n2.send(MsgType.HEALTH, {"node": "n2", "verdict": "failed"})
        admin.send(MsgType.HEALTH, {"node": "n1", "verdict": "failed"})
        for _ in range(3):
            assert server.channel.recv(1.0) is None
        assert server.channel.rejected == 3
        for c in (n1, as_n2, admin):
            err = c.recv(2.0)
            assert err is not None and err[1].type is MsgType.ERROR and err[1].body["code"] == "identity"
        # A raw frame whose routing id is not its sender is refused too.
        n1.sock.send(encode(Sequencer("n1/w0/1").make(MsgType.HEARTBEAT, {"node": "n1"})))
        assert server.channel.recv(1.0) is None
        # What the key is allowed to say gets through.
        n1.send(MsgType.HEALTH, {"node": "n1", "verdict": "healthy", "reasons": []})
        admin.send(MsgType.STATUS, {})
        got = [server.channel.recv(2.0) for _ in range(2)]
        assert sorted(g[1].sender for g in got if g) == ["cli-1", "n1/node"]
        assert "cannot speak for node 'n2'" in caplog.text
    finally:
        for c in (n1, as_n2, admin):
            c.close()
        server.close()


def test_replayed_frames_are_rejected(keys: KeyDir, ctx) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    n1 = connect(ctx, server.endpoint, keys.node("n1"), "n1/node")
    try:
        seq = Sequencer("n1/node")
        frame = encode(seq.make(MsgType.WORKER_EXIT, {"node": "n1", "local_rank": 0, "pid": 5, "returncode": -9}))
        older = encode(Message(MsgType.HEARTBEAT, "n1/node", 5, time.time() + 10, {"node": "n1"}))
        for _ in range(3):
            n1.sock.send(frame)
        n1.sock.send(older)
        assert server.channel.recv(2.0) is not None  # once
        assert server.channel.recv(0.5) is None and server.channel.recv(0.5) is None
        assert server.channel.recv(0.5) is None
        assert server.channel.rejected == 3
        codes = [n1.recv(2.0)[1].body["code"] for _ in range(3)]
        assert codes == ["replay"] * 3
        n1.sock.send(encode(seq.make(MsgType.HEARTBEAT, {"node": "n1"})))
        assert server.channel.recv(2.0) is not None
    finally:
        n1.close()
        server.close()


def test_every_socket_has_a_size_limit_and_a_huge_frame_is_dropped(keys: KeyDir, ctx) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    big = connect(ctx, server.endpoint, keys.node("n1"), "n1/node")
    ok = connect(ctx, server.endpoint, keys.node("n2"), "n2/node")
    try:
        for ch in (server.channel, big, ok):
            assert ch.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
        big.sock.send(b"x" * (8 * MAX_FRAME_BYTES))  # libzmq drops the connection, never buffers it
        ok.send(MsgType.HEARTBEAT, {"node": "n2"})
        got = server.channel.recv(2.0)
        assert got is not None and got[1].sender == "n2/node"
        assert server.channel.recv(0.5) is None
        # A reply over the limit is not sent (the peer would drop the connection): an ERROR is.
        server.channel.send(MsgType.STATUS_REPLY, {"blob": "y" * MAX_FRAME_BYTES}, to=got[0])
        err = ok.recv(2.0)
        assert err is not None and err[1].type is MsgType.ERROR and err[1].body["code"] == "too_large"
    finally:
        big.close()
        ok.close()
        server.close()


def test_routing_ids_are_unguessable_and_a_key_holder_cannot_take_a_connection_over(keys: KeyDir, ctx) -> None:
    """Each socket's routing id is its sender and a random nonce (no key holder can take
    another node's first), and a second connection with an id in use does not take it:
    the controller's replies still reach the first (finding 13; with ROUTER_HANDOVER
    they went to the newcomer)."""
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    first = connect(ctx, server.endpoint, keys.node("n1"), "n1/node")
    other = connect(ctx, server.endpoint, keys.node("n1"), "n1/node")
    thief = ctx.socket(zmq.DEALER)
    try:
        first.send(MsgType.HEARTBEAT, {"node": "n1"})
        got = server.channel.recv(2.0)
        assert got is not None and got[1].sender == "n1/node"
        ident = got[0]
        assert ident.startswith(b"n1/node#") and len(ident) == len(b"n1/node#") + 16 and peer_name(ident) == b"n1/node"
        assert first.sock.getsockopt(zmq.IDENTITY) == ident != other.sock.getsockopt(zmq.IDENTITY)
        # Another node's key holder who learned the routing id connects under it.
        thief.setsockopt(zmq.LINGER, 0)
        thief.setsockopt(zmq.IDENTITY, ident)
        thief.curve_publickey, thief.curve_secretkey = keys.node("n2").client()
        thief.curve_serverkey = keys.server_public()
        thief.connect(server.endpoint)
        thief.send(encode(Sequencer("n2/node").make(MsgType.HEARTBEAT, {"node": "n2"})))
        assert server.channel.recv(0.5) is None  # its connection is never identified
        server.channel.send(MsgType.STATUS_REPLY, {}, to=ident)
        assert first.recv(2.0) is not None
        assert not thief.poll(300, zmq.POLLIN)
    finally:
        thief.close(linger=0)
        first.close()
        other.close()
        server.close()


def test_a_dropped_connection_comes_back_under_a_fresh_routing_id_past_its_ghost(keys: KeyDir, ctx) -> None:
    """A node whose connection drops while the controller still holds it (a ghost) is
    not locked out: it reconnects under a fresh routing id, and replies reach it."""
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    proxy = CuttableProxy(int(server.endpoint.rsplit(":", 1)[1]))
    node = connect(ctx, f"tcp://127.0.0.1:{proxy.port}", keys.node("n1"), "n1/node")
    try:
        node.send(MsgType.HEARTBEAT, {"node": "n1"})
        got = server.channel.recv(5.0)
        assert got is not None
        old = got[0]
        proxy.cut_clients()
        deadline = time.monotonic() + 10.0
        new = None
        while new is None and time.monotonic() < deadline:
            node.send(MsgType.HEARTBEAT, {"node": "n1"})
            got = server.channel.recv(0.2)
            if got is not None and got[0] != old:
                new = got[0]
        assert new is not None and peer_name(new) == b"n1/node", "the node never came back"
        assert node.renewals >= 1 and node.sock.getsockopt(zmq.IDENTITY) == new
        server.channel.send(MsgType.STATUS_REPLY, {}, to=new)
        deadline = time.monotonic() + 5.0
        reply = None
        while reply is None and time.monotonic() < deadline:
            got2 = node.recv(0.2)
            reply = got2[1] if got2 is not None and got2[1].type is MsgType.STATUS_REPLY else None
        assert reply is not None
    finally:
        node.close()
        proxy.close()
        server.close()


def test_a_refused_key_is_not_connected_again_per_send(keys: KeyDir, ctx, tmp_path: Path) -> None:
    """A connection refused in its handshake never was the ROUTER's (no ghost): libzmq
    retries it as it did, and the channel neither renews per send nor hides why."""
    import shutil

    import zmq.auth

    stranger = tmp_path / "stranger"
    stranger.mkdir()
    zmq.auth.create_certificates(str(stranger), "client")  # a key nobody authorized
    shutil.copy(keys.path / "server.key", stranger / "server.key")
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    ch = connect(ctx, server.endpoint, KeyDir(stranger), "x/node")
    try:
        deadline = time.monotonic() + 5.0
        while ch.handshake_failed is None and time.monotonic() < deadline:
            ch.send(MsgType.HEARTBEAT, {"node": "x"})
            time.sleep(0.05)
        assert ch.handshake_failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        for _ in range(10):
            ch.send(MsgType.HEARTBEAT, {"node": "x"})
            time.sleep(0.02)
        assert ch.renewals == 0
        assert server.channel.recv(0.2) is None
    finally:
        ch.close()
        server.close()
