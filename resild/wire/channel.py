"""ZeroMQ ROUTER/DEALER with CURVE, and a typed channel over them.

The controller binds a ROUTER (`Server`); agents, node processes and workers connect
DEALERs (`connect`). The controller takes a message's node from the key that
authenticated it: `Server`'s channel drops (ERROR reply + log, and `on_refused` names
the key's holder) any message whose routing id, sender or body "node" names another
node, and any replayed or reordered `seq` (per-sender high-water mark).

Routing ids are unguessable and never reused: `connect` gives each connection
`<sender>#<random>`, and a DEALER whose connection drops reconnects under a fresh one
(`Channel.renew`). The ROUTER keeps the first connection that claims a routing id: a key
holder who learned a node's routing id (64 random bits, CURVE-encrypted on the wire)
cannot take its connection over (issue 39), and a node is never locked out by the ghost
of its own dropped connection, because it no longer comes back under that id. libzmq
without ROUTER_HANDOVER leaves a second connection with an id in use unidentified for as
long as it lives, so reusing an id after a drop the ROUTER has not noticed yet would lock
the node out for good. Only a connection whose handshake succeeded is renewed (one
refused in it never was the ROUTER's). The controller learns the new id from the next
message: a node process's heartbeat (it replies to the id each node's key last used), a
worker's registration, which its link sends again when its link to the leader is renewed
(`ControllerSet.renewed`).
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from resild.wire.keys import ADMIN, KeyDir, _KeyAuthenticator
from resild.wire.protocol import MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Sequencer, decode, encode

log = logging.getLogger(__name__)

MAX_SENDERS = 65536  # high-water marks kept (oldest forgotten first)
LINK_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
NONCE_SEP = b"#"  # a routing id is the sender, then this and a random nonce (`connect`)


def routing_id(sender: str) -> bytes:
    """A fresh routing id for a socket of `sender`: its name, then 64 random bits."""
    return sender.encode() + NONCE_SEP + secrets.token_hex(8).encode()


def peer_name(ident: bytes) -> bytes:
    """The sender a routing id is for (its nonce cut off)."""
    return ident.split(NONCE_SEP, 1)[0]


# Told of every message refused for its identity: (the key's holder, its routing id, why).
Refused = Callable[[str, bytes | None, str], None]


class Channel:
    """One socket plus framing. `recv` always takes a timeout; bad frames never raise.

    With `authenticated` (a CURVE ROUTER) every message must come from a peer whose
    routing id and sender are its key's identity (`node` or `node/...`) and whose body
    "node", when present, is that identity; seq must rise per sender."""

    def __init__(
        self,
        sock: zmq.SyncSocket,
        sender: str,
        router: bool,
        authenticated: bool = False,
        endpoint: str | None = None,
        monitor: zmq.SyncSocket | None = None,
    ) -> None:
        self.sock = sock
        self.sender = sender
        self.endpoint = endpoint  # a DEALER's: where `renew` connects again
        self.monitor = monitor  # a DEALER's connection events (`link_events`)
        self.renewals = 0  # connections dropped and made again under a fresh routing id
        self.handshake_failed: int | None = None  # the last zmq.EVENT_HANDSHAKE_FAILED_* seen
        self._up = False  # a connection's handshake succeeded and it has not dropped since
        self._dropped = False  # such a connection dropped, the renewal waiting for its pipe to be read
        self.router = router
        self.authenticated = authenticated
        self.seq = Sequencer(sender)
        self.rejected = 0  # frames dropped as malformed / wrong version / expired / replayed / forged
        self.on_refused: Refused | None = None  # the controller names the key holder (event)
        self._hwm: OrderedDict[tuple[str, str], int] = OrderedDict()

    def send(
        self, mtype: MsgType, body: dict[str, Any] | None = None, *, to: bytes | None = None, ttl_s: float | None = None
    ) -> None:
        self.link_events()  # a dropped connection is made again before this message goes out
        try:
            frame = encode(self.seq.make(mtype, body, ttl_s))
        except (TypeError, ValueError) as e:  # not JSON, or NaN: a bug on our side, not the peer's
            log.error("cannot send %s: %s", mtype.value, e)
            return
        if len(frame) > MAX_FRAME_BYTES:  # the peer's MAXMSGSIZE would drop the connection
            log.error("not sending %s: %d bytes > %d", mtype.value, len(frame), MAX_FRAME_BYTES)
            frame = encode(
                self.seq.make(MsgType.ERROR, {"code": "too_large", "detail": f"{mtype.value} reply too large"})
            )
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

    def _reject(self, ident: bytes | None, code: str, detail: str) -> None:
        self.rejected += 1
        # A flood of bad frames must not become a flood of log lines (a full disk next).
        if self.rejected <= 100 or self.rejected % 1000 == 0:
            log.warning(
                "rejected frame from %r: %s: %s%s",
                ident[:64] if ident else ident,
                code,
                detail,
                f" ({self.rejected} rejected so far)" if self.rejected >= 100 else "",
            )
        if self.router and ident is not None:
            self.send(MsgType.ERROR, {"code": code, "detail": detail}, to=ident)

    def recv(self, timeout_s: float) -> tuple[bytes | None, Message] | None:
        """Return (peer identity or None, message) or None on timeout or a dropped frame.
        `timeout_s` <= 0 (a loop draining its queue): one non-blocking receive, no poll."""
        self.link_events()
        if timeout_s > 0 and not self.poll(timeout_s):
            return None
        try:
            parts = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        ident = parts[0].bytes if self.router else None
        if len(parts) != (2 if self.router else 1):
            self._reject(ident, "malformed", f"{len(parts) - (1 if self.router else 0)} frames, expected 1")
            return None
        frame = parts[-1]
        try:
            msg = decode(frame.bytes)
        except ProtocolError as e:
            self._reject(ident, e.code, e.detail)
            return None
        user = ""
        if self.authenticated:
            try:
                got = frame.get("User-Id")  # a str property; int only for numeric options
                user = got if isinstance(got, str) else ""
            except zmq.ZMQError:
                user = ""
            why = _forged(user, ident, msg)
            if why:
                self._reject(ident, "identity", f"key {user or '?'}: {why}")
                if self.on_refused is not None:
                    self.on_refused(user, ident, why)
                return None
        if msg.expired():
            self.rejected += 1
            if self.rejected <= 100 or self.rejected % 1000 == 0:
                log.warning("dropped expired %s from %s (seq %d)", msg.type.value, msg.sender, msg.seq)
            return None
        key = (user, msg.sender)
        last = self._hwm.get(key)
        if last is not None and msg.seq <= last:
            self._reject(ident, "replay", f"seq {msg.seq} from {msg.sender} not above {last}")
            return None
        self._hwm[key] = msg.seq
        self._hwm.move_to_end(key)
        if len(self._hwm) > MAX_SENDERS:
            self._hwm.popitem(last=False)
        return ident, msg

    def link_events(self) -> None:
        """Read a DEALER's connection events, non-blocking. A dropped connection is
        renewed once everything it delivered has been read (renewing drops the old pipe
        with what is queued in it: a controller's last SHUTDOWN before it closed, say). A
        handshake failure stays in `handshake_failed` (a controller that refuses a key
        says nothing else)."""
        if self.monitor is None:
            return
        while True:
            try:
                frames = self.monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # nothing more (zmq.Again), or the monitor stopped (closing)
                break
            if not frames or len(frames[0]) < 2:
                continue
            ev = int.from_bytes(frames[0][:2], "little")  # libzmq's v1 event: uint16 id first
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._up, self.handshake_failed = True, None
            elif ev in _FAILED:
                self.handshake_failed = ev
            elif ev == zmq.EVENT_DISCONNECTED and self._up:
                # Only a connection the ROUTER identified can leave a ghost: one refused in
                # its handshake is retried by libzmq as it was (not a renewal per send).
                self._up, self._dropped = False, True
        if self._dropped and not self.sock.poll(0, zmq.POLLIN):
            self._dropped = False
            self.renew()

    def renew(self) -> None:
        """Connect again under a fresh routing id. libzmq would reconnect under the old
        one, and the ROUTER, which does not hand an id in use over, could still hold the
        dropped connection's ghost: the new connection would be unidentified for good.
        What is still queued to send on the old connection is dropped; control traffic
        is best-effort."""
        if self.endpoint is None:
            return
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # libzmq dropped the endpoint already
        self.sock.setsockopt(zmq.IDENTITY, routing_id(self.sender))
        self.sock.connect(self.endpoint)
        self.renewals += 1
        log.info("connection to %s dropped: connected again under a fresh routing id", self.endpoint)

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
            self.monitor = None
        self.sock.close(linger=linger_ms)


def _forged(user: str, ident: bytes | None, msg: Message) -> str:
    """Why this message does not come from who it says, or "" if it does."""
    if not user:
        return "no authenticated identity"
    if ident is not None and peer_name(ident) != msg.sender.encode():
        return f"routing id {ident[:64]!r} does not match sender {msg.sender[:64]!r}"
    node = msg.body.get("node")
    if user == ADMIN:
        return f"the operator key speaks for no node (body names {str(node)[:64]!r})" if node is not None else ""
    if msg.sender != user and not msg.sender.startswith(user + "/"):
        return f"sender {msg.sender!r} is not {user!r}'s"
    if node is not None and node != user:
        return f"key of {user!r} cannot speak for node {str(node)[:64]!r}"
    return ""


def limit_frame_size(sock: zmq.SyncSocket) -> None:
    """For every socket carrying protocol frames; call before bind/connect (libzmq
    copies the options then). libzmq drops a peer that sends a bigger frame before
    buffering it: a 512 MiB frame would otherwise sit in memory until decode() refused it."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


def _set_curve_client(sock: zmq.SyncSocket, keys: KeyDir) -> None:
    pub, sec = keys.client()
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    sock.curve_serverkey = keys.server_public()


class Server:
    """The controller's ROUTER, with a ZAP authenticator accepting only authorized keys."""

    def __init__(self, ctx: zmq.SyncContext, bind: str, keys: KeyDir | None, sender: str = "controller") -> None:
        self.auth: ThreadAuthenticator | None = None
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # No ROUTER_HANDOVER: the first connection keeps its routing id (module docstring).
        limit_frame_size(sock)
        if keys is not None:
            auth = _KeyAuthenticator(ctx, keys.authorized)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=auth)
            self.auth = auth
            pub, sec = keys.server()
            sock.curve_publickey, sock.curve_secretkey, sock.curve_server = pub, sec, True
        sock.bind(bind)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.channel = Channel(sock, sender, router=True, authenticated=keys is not None)

    def close(self) -> None:
        self.channel.close()
        if self.auth is not None:
            self.auth.stop()


def connect(ctx: zmq.SyncContext, endpoint: str, keys: KeyDir | None, sender: str, *, watch: bool = True) -> Channel:
    """A DEALER to `endpoint`. `watch=False` (a bench simulating thousands of nodes in one
    process): no socket monitor, so no renewal of a dropped connection and no
    `handshake_failed`; every real peer watches."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    limit_frame_size(sock)
    sock.setsockopt(zmq.IDENTITY, routing_id(sender))  # unguessable: no one can take it first
    if keys is not None:
        _set_curve_client(sock, keys)
    # Drops renew the routing id; handshake failures tell a client its key was refused.
    monitor = sock.get_monitor_socket(LINK_EVENTS) if watch else None
    sock.connect(endpoint)
    return Channel(sock, sender, router=False, endpoint=endpoint, monitor=monitor)
