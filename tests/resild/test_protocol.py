"""Framing, versioning and authentication over real ZeroMQ sockets on loopback."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import zmq

from resild.protocol import PROTOCOL_VERSION, Message, MsgType, ProtocolError, decode, encode
from resild.transport import KeyDir, Server, connect, generate_keys


def test_round_trip() -> None:
    m = Message(MsgType.HEARTBEAT, "n1/node", 7, time.time() + 5, {"node": "n1"})
    assert decode(encode(m)) == m


@pytest.mark.parametrize("frame,code", [
    (b"\xff\xfe", "malformed"),
    (b"[1,2]", "malformed"),
    (json.dumps({"v": 99, "type": "heartbeat", "sender": "x", "seq": 1, "deadline": 1}).encode(), "bad_version"),
    (json.dumps({"v": PROTOCOL_VERSION, "type": "nope", "sender": "x", "seq": 1, "deadline": 1}).encode(), "bad_type"),
    (json.dumps({"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "", "seq": 1, "deadline": 1}).encode(), "malformed"),
    (json.dumps({"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "x", "seq": -1, "deadline": 1}).encode(), "malformed"),
    (json.dumps({"v": PROTOCOL_VERSION, "type": "heartbeat", "sender": "x", "seq": 1, "deadline": 1, "body": []}).encode(), "malformed"),
    (b"x" * (2 << 20), "too_large"),
])
def test_decode_rejects(frame: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(frame)
    assert e.value.code == code


@pytest.fixture
def keys(tmp_path: Path) -> KeyDir:
    k = generate_keys(tmp_path / "keys")
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


def test_bad_frames_get_an_error_reply_and_the_server_keeps_serving(keys: KeyDir, ctx, caplog) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    client = connect(ctx, server.endpoint, keys, "c1")
    try:
        caplog.set_level(logging.WARNING)
        client.sock.send(b"not json at all")
        client.sock.send(json.dumps({"v": 42, "type": "heartbeat", "sender": "c1", "seq": 1, "deadline": 1e12}).encode())
        assert server.channel.recv(2.0) is None and server.channel.recv(2.0) is None
        errs = [client.recv(2.0) for _ in range(2)]
        assert [e[1].body["code"] for e in errs] == ["malformed", "bad_version"]
        assert server.channel.rejected == 2 and "rejected frame" in caplog.text
        client.send(MsgType.STATUS, {})
        assert _serve_once(server) is not None
        reply = client.recv(2.0)
        assert reply is not None and reply[1].type == MsgType.STATUS_REPLY
    finally:
        client.close()
        server.close()


def test_expired_messages_are_dropped(keys: KeyDir, ctx) -> None:
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    client = connect(ctx, server.endpoint, keys, "c1")
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
    good = connect(ctx, server.endpoint, keys, "good")
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
