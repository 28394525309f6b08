"""ZeroMQ sockets with CURVE authentication, and a typed channel over them.

The controller binds a ROUTER; agents, node processes and workers connect
DEALERs. Keys are generated per job (local mode) or provisioned by the site
(cluster mode) in a directory holding `server.key`, `server.key_secret`,
`client.key`, `client.key_secret` and `authorized/` (the client public keys
the controller accepts). Secret files are 0600.
"""
from __future__ import annotations

import logging
import os
import socket
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .protocol import Message, MsgType, ProtocolError, Sequencer, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyDir:
    path: Path

    @property
    def authorized(self) -> Path:
        return self.path / "authorized"

    def server(self) -> tuple[bytes, bytes]:
        return _load(self.path / "server.key_secret")

    def client(self) -> tuple[bytes, bytes]:
        return _load(self.path / "client.key_secret")

    def server_public(self) -> bytes:
        pub, _ = zmq.auth.load_certificate(str(self.path / "server.key"))
        return pub


def _load(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.exists():
        raise FileNotFoundError(f"CURVE key {secret_file} is missing (run `resild keys` or let resil-run make them)")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    assert sec is not None
    return pub, sec


def generate_keys(path: Path) -> KeyDir:
    """Create a fresh server and client key pair under `path` (mode 0700/0600)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(path), name)
        os.chmod(path / f"{name}.key_secret", 0o600)
    (path / "authorized").mkdir(exist_ok=True)
    shutil.copy(path / "client.key", path / "authorized" / "client.key")
    return KeyDir(path)


class Channel:
    """One socket plus framing. `recv` always takes a timeout; bad frames never raise."""

    def __init__(self, sock: zmq.Socket, sender: str, router: bool) -> None:
        self.sock = sock
        self.router = router
        self.seq = Sequencer(sender)
        self.rejected = 0  # frames dropped as malformed / wrong version / expired

    def send(self, mtype: MsgType, body: dict | None = None, *, to: bytes | None = None,
             ttl_s: float | None = None) -> None:
        frame = encode(self.seq.make(mtype, body, ttl_s))
        try:
            if self.router:
                assert to is not None, "a ROUTER send needs the peer identity"
                self.sock.send_multipart([to, frame], flags=zmq.NOBLOCK)
            else:
                self.sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            # Peer gone or its queue is full: control traffic is best-effort,
            # liveness is judged by heartbeats, not by send success.
            log.debug("send %s dropped: peer queue full", mtype.value)

    def poll(self, timeout_s: float) -> bool:
        return bool(self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))

    def recv(self, timeout_s: float) -> tuple[bytes | None, Message] | None:
        """Return (peer identity or None, message) or None on timeout or a dropped frame."""
        if not self.poll(timeout_s):
            return None
        parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
        ident = parts[0] if self.router else None
        frame = parts[-1]
        try:
            msg = decode(frame)
        except ProtocolError as e:
            self.rejected += 1
            log.warning("rejected frame from %r: %s", ident, e)
            if self.router and ident is not None:
                self.send(MsgType.ERROR, {"code": e.code, "detail": e.detail}, to=ident)
            return None
        if msg.expired():
            self.rejected += 1
            log.warning("dropped expired %s from %s (seq %d)", msg.type.value, msg.sender, msg.seq)
            return None
        return ident, msg

    def close(self) -> None:
        self.sock.close(linger=0)


def _set_curve_client(sock: zmq.Socket, keys: KeyDir) -> None:
    pub, sec = keys.client()
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    sock.curve_serverkey = keys.server_public()


class Server:
    """The controller's ROUTER, with a ZAP authenticator accepting only authorized keys."""

    def __init__(self, ctx: zmq.Context, bind: str, keys: KeyDir | None, sender: str = "controller") -> None:
        self.auth: ThreadAuthenticator | None = None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("resild.auth"))
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(keys.authorized))
            pub, sec = keys.server()
            sock.curve_publickey, sock.curve_secretkey, sock.curve_server = pub, sec, True
        sock.bind(bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.channel = Channel(sock, sender, router=True)

    def close(self) -> None:
        self.channel.close()
        if self.auth is not None:
            self.auth.stop()


def connect(ctx: zmq.Context, endpoint: str, keys: KeyDir | None, sender: str) -> Channel:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt_string(zmq.IDENTITY, sender)
    if keys is not None:
        _set_curve_client(sock, keys)
    sock.connect(endpoint)
    return Channel(sock, sender, router=False)


def local_request(endpoint: str, mtype: MsgType, body: dict | None = None,
                  timeout_s: float = 3.0, ctx: zmq.Context | None = None) -> Message | None:
    """One REQ/REP exchange with a node daemon's local socket; None when nothing
    answers in time. A fresh socket each time: a lost reply never wedges the next."""
    ctx = ctx or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(Sequencer(f"{socket.gethostname()}/req-{os.getpid()}").make(mtype, body)))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return decode(sock.recv())
    except (zmq.ZMQError, ProtocolError) as e:
        log.debug("request to %s failed: %s", endpoint, e)
        return None
    finally:
        sock.close(linger=0)
