"""ZeroMQ sockets with CURVE authentication, and a typed channel over them.

The controller binds a ROUTER; agents, node processes and workers connect
DEALERs. Keys are generated per job (local mode) or provisioned by the site
(cluster mode) by `generate_keys`:

    DIR/server.key, server.key_secret     the controller's pair (stays on the controller host)
    DIR/client.key, client.key_secret     the operator's pair (User-Id "client": `resild cluster`)
    DIR/authorized/<name>.key             every public key the controller accepts; the file
                                          name is the identity (ZAP User-Id) of its holder
    DIR/nodes/<node>/                     what node <node> gets, and nothing else: its own
                                          pair plus the server's *public* key

A node's processes (node process, workers, node daemon) hold only their node's
secret key, and the controller takes a message's node from the key that
authenticated it: `Server`'s channel drops (ERROR reply + log) any message whose
routing id, sender or body "node" names another node, and any replayed or
reordered `seq` (per-sender high-water mark). Secret files are 0600.

The node daemon's local status socket is a plain AF_UNIX stream socket
(`UnixServer`, `local_request`): length-prefixed protocol frames, the peer's
uid/pid from SO_PEERCRED, bounded clients, frames and idle time.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from resild.wire.protocol import MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Sequencer, decode, encode

log = logging.getLogger(__name__)

ADMIN = "client"  # identity of DIR/client.key, the operator's (`resild cluster`): may ask
# for status, speaks for no node (name kept from the one-key layout)
NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
MAX_SENDERS = 65536  # high-water marks kept (oldest forgotten first)


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

    def node(self, name: str) -> KeyDir:
        """The directory to hand to node `name` (its pair + the server's public key only)."""
        return KeyDir(self.path / "nodes" / name)


def _load(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.exists():
        raise FileNotFoundError(f"CURVE key {secret_file} is missing (run `resild keys` or let resil-run make them)")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    assert sec is not None
    return pub, sec


def _pair(directory: Path, name: str) -> None:
    zmq.auth.create_certificates(str(directory), name)
    os.chmod(directory / f"{name}.key_secret", 0o600)


def generate_keys(path: Path, nodes: Iterable[str] = ()) -> KeyDir:
    """Create the server pair, the operator pair and one pair per node under `path`
    (directories 0700, secrets 0600); see the module docstring for the layout."""
    if path.exists():
        shutil.rmtree(path)  # a reused run directory: this job's keys only, nothing stale stays authorized
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    _pair(path, "server")
    _pair(path, "client")
    (path / "authorized").mkdir(exist_ok=True)
    shutil.copy(path / "client.key", path / "authorized" / f"{ADMIN}.key")
    for node in nodes:
        add_node_key(KeyDir(path), node)
    return KeyDir(path)


def add_node_key(keys: KeyDir, node: str) -> KeyDir:
    if not NODE_NAME.fullmatch(node) or node == ADMIN:
        raise ValueError(f"node name {node!r} cannot name a key (letters, digits, _ . - only)")
    d = keys.node(node).path
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _pair(d, "client")
    shutil.copy(keys.path / "server.key", d / "server.key")
    shutil.copy(d / "client.key", keys.authorized / f"{node}.key")
    return KeyDir(d)


class _KeyAuthenticator(ThreadAuthenticator):
    """ZAP handler: accepts exactly the keys in authorized/ and reports the file's
    name as the connection's User-Id (readable on every received frame)."""

    RESCAN_S = 0.5  # an unknown key re-reads authorized/ at most this often

    def __init__(self, ctx: zmq.Context, authorized: Path) -> None:
        super().__init__(ctx, log=logging.getLogger("resild.auth"))
        self.authorized = authorized
        self.user_ids: dict[bytes, str] = {}
        self._scanned_s = -1e9
        self._scan()

    def _scan(self) -> None:
        """Node keys may be added after the server started (a backend makes them just
        before it starts the nodes): re-read the directory. Runs on the auth thread."""
        self._scanned_s = time.monotonic()
        self._mtime_ns = self._dir_mtime()
        ids: dict[bytes, str] = {}
        for f in sorted(self.authorized.glob("*.key")):
            try:
                pub, _ = zmq.auth.load_certificate(str(f))
            except (OSError, ValueError) as e:
                log.error("ignoring unreadable key %s: %s", f, e)
                continue
            ids[pub] = f.stem  # load_certificate returns the z85 text
        self.user_ids = ids

    def _dir_mtime(self) -> int:
        try:
            return self.authorized.stat().st_mtime_ns
        except OSError:
            return -1

    def callback(self, domain: str, z85_key: bytes) -> bool:  # credentials provider
        if z85_key not in self.user_ids and (
            self._dir_mtime() != self._mtime_ns or time.monotonic() - self._scanned_s >= self.RESCAN_S
        ):
            self._scan()
        ok = z85_key in self.user_ids
        if not ok:
            self.log.warning("DENIED unknown CURVE key %s", z85_key.decode(errors="replace"))
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.user_ids[z85.encode(client_public_key)]


class Channel:
    """One socket plus framing. `recv` always takes a timeout; bad frames never raise.

    With `authenticated` (a CURVE ROUTER) every message must come from a peer whose
    routing id and sender are its key's identity (`node` or `node/...`) and whose body
    "node", when present, is that identity; seq must rise per sender."""

    def __init__(self, sock: zmq.Socket, sender: str, router: bool, authenticated: bool = False) -> None:
        self.sock = sock
        self.router = router
        self.authenticated = authenticated
        self.seq = Sequencer(sender)
        self.rejected = 0  # frames dropped as malformed / wrong version / expired / replayed / forged
        self._hwm: OrderedDict[tuple[str, str], int] = OrderedDict()

    def send(
        self, mtype: MsgType, body: dict | None = None, *, to: bytes | None = None, ttl_s: float | None = None
    ) -> None:
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
        """Return (peer identity or None, message) or None on timeout or a dropped frame."""
        if not self.poll(timeout_s):
            return None
        parts = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
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
                user = frame.get("User-Id")
            except zmq.ZMQError:
                user = ""
            why = _forged(user, ident, msg)
            if why:
                self._reject(ident, "identity", why)
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

    def close(self) -> None:
        self.sock.close(linger=0)


def _forged(user: str, ident: bytes | None, msg: Message) -> str:
    """Why this message does not come from who it says, or "" if it does."""
    if not user:
        return "no authenticated identity"
    if ident is not None and ident != msg.sender.encode():
        return f"routing id does not match sender {msg.sender!r}"
    node = msg.body.get("node")
    if user == ADMIN:
        return f"the operator key speaks for no node (body names {str(node)[:64]!r})" if node is not None else ""
    if msg.sender != user and not msg.sender.startswith(user + "/"):
        return f"sender {msg.sender!r} is not {user!r}'s"
    if node is not None and node != user:
        return f"key of {user!r} cannot speak for node {str(node)[:64]!r}"
    return ""


def limit_frame_size(sock: zmq.Socket) -> None:
    """For every socket carrying protocol frames; call before bind/connect (libzmq
    copies the options then). libzmq drops a peer that sends a bigger frame before
    buffering it: a 512 MiB frame would otherwise sit in memory until decode() refused it."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)


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


def connect(ctx: zmq.Context, endpoint: str, keys: KeyDir | None, sender: str) -> Channel:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    limit_frame_size(sock)
    sock.setsockopt_string(zmq.IDENTITY, sender)
    if keys is not None:
        _set_curve_client(sock, keys)
    sock.connect(endpoint)
    return Channel(sock, sender, router=False)


class ControllerSet:
    """A peer's links to the controller replicas, one DEALER per endpoint (the same list,
    in the same order, everywhere). The leader is the replica that last spoke with the
    highest lease term: standbys never send, and a deposed leader's older term is
    ignored. Until a leader has spoken, sends go to every replica (only the leader acts
    on them); with one endpoint it is the leader from the start."""

    def __init__(self, ctx: zmq.Context, endpoints: list[str], keys: KeyDir | None, sender: str) -> None:
        if not endpoints or not all(endpoints):
            raise ValueError("no controller endpoint given")
        self.endpoints = list(endpoints)
        self.chans = [connect(ctx, ep, keys, sender) for ep in self.endpoints]
        self.leader: int | None = 0 if len(self.chans) == 1 else None
        self.term = 0

    @property
    def socks(self) -> list[zmq.Socket]:
        return [c.sock for c in self.chans]

    @property
    def leader_endpoint(self) -> str:
        return self.endpoints[self.leader] if self.leader is not None else ",".join(self.endpoints)

    def send(self, mtype: MsgType, body: dict | None = None, *, ttl_s: float | None = None) -> None:
        for c in [self.chans[self.leader]] if self.leader is not None else self.chans:
            c.send(mtype, body, ttl_s=ttl_s)

    def send_all(self, mtype: MsgType, body: dict | None = None, *, ttl_s: float | None = None) -> None:
        """Liveness and registration: a standby that takes over knows its peers at once."""
        for c in self.chans:
            c.send(mtype, body, ttl_s=ttl_s)

    def follow(self, term: int, leader: int) -> bool:
        """A lease of `term` naming replica `leader`: True when this is a new leader (or a
        restarted one) that must be told who we are again."""
        if term <= self.term or not 0 <= leader < len(self.chans):
            return False
        # The first leader heard our registration (sent to every replica): nothing to repeat.
        new = self.term > 0 or (self.leader is not None and self.leader != leader)
        self.term, self.leader = term, leader
        return new

    def recv(self, index: int) -> Message | None:
        """The next message from replica `index` that counts: from the leader, or a lease
        with a newer term (the caller follows it); anything else is dropped. The first
        replica to speak is the leader until a lease says otherwise."""
        while (got := self.chans[index].recv(0)) is not None:
            msg = got[1]
            if self.leader is None:
                self.leader = index
            if index == self.leader or (msg.type == MsgType.LEASE and int(msg.body.get("term", 0)) > self.term):
                return msg
        return None

    def index_of(self, sock: Any) -> int | None:
        for i, c in enumerate(self.chans):
            if c.sock is sock:
                return i
        return None

    def close(self, linger_ms: int = 0) -> None:
        for c in self.chans:
            c.sock.close(linger=linger_ms)


# ---- the node daemon's local socket ---------------------------------------------------

_LEN = struct.Struct("!I")


def unix_path(endpoint: str) -> str | None:
    """The filesystem path of an ipc:// endpoint (or a bare path); None for anything else."""
    if endpoint.startswith("ipc://"):
        return endpoint[6:]
    return None if "://" in endpoint else endpoint


def local_request(
    endpoint: str, mtype: MsgType, body: dict | None = None, timeout_s: float = 3.0, ctx: zmq.Context | None = None
) -> Message | None:
    """One request/reply with a node daemon's local socket; None when nothing
    answers in time. A fresh connection each time: a lost reply never wedges the next.
    (`ctx` is accepted for callers of the former ZeroMQ version and unused.)"""
    path = unix_path(endpoint)
    if path is None:
        log.debug("request to %s: only ipc:// (unix socket) endpoints are served by the daemon", endpoint)
        return None
    deadline = time.monotonic() + timeout_s
    try:
        frame = encode(Sequencer(f"{socket.gethostname()}/req-{os.getpid()}").make(mtype, body))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(max(0.001, timeout_s))
            s.connect(path)
            s.sendall(_LEN.pack(len(frame)) + frame)
            return read_frame(s, deadline)
    except (OSError, ProtocolError, ValueError) as e:
        log.debug("request to %s failed: %s", endpoint, e)
        return None


def send_frame(s: socket.socket, msg: Message) -> None:
    """One length-prefixed frame on the daemon's unix socket (blocking)."""
    frame = encode(msg)
    s.sendall(_LEN.pack(len(frame)) + frame)


def read_frame(s: socket.socket, deadline: float) -> Message:
    """One length-prefixed frame from the daemon's unix socket, by `deadline` (monotonic).
    Raises TimeoutError/ConnectionError (OSError) or ProtocolError."""
    n = _LEN.unpack(_recv_exact(s, _LEN.size, deadline))[0]
    if n > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"frame of {n} bytes")
    return decode(_recv_exact(s, n, deadline))


def _recv_exact(s: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no reply in time")
        s.settimeout(left)
        chunk = s.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise ConnectionError("daemon closed the connection")
        buf += chunk
    return bytes(buf)


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a unix socket, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "outbuf", "last_s")

    def __init__(self, sock: socket.socket, peer: Peer, now: float) -> None:
        self.sock, self.peer, self.last_s = sock, peer, now
        self.inbuf = bytearray()
        self.outbuf = bytearray()


class UnixServer:
    """Request/reply over an AF_UNIX stream socket, driven by the owner's poll loop.

    Each request is a 4-byte big-endian length and one protocol frame; each gets one
    reply frame. Bounds, so no client can exhaust the server: at most `max_clients`
    connections (`max_per_uid` for one non-root uid; excess connections are closed
    at once, so file descriptors never run out), requests of at most
    `max_request_bytes` (the length is checked before anything is buffered), connections idle for
    `idle_timeout_s` are closed, and a client that does not read its reply is not
    read from until it does. `handler(frame, peer)` returns the reply frame and
    must not raise (an exception closes that connection only, and is logged)."""

    def __init__(
        self,
        path: str,
        handler: Callable[[bytes, Peer], bytes],
        *,
        mode: int = 0o660,
        gid: int | None = None,
        max_clients: int = 128,
        max_per_uid: int = 32,
        idle_timeout_s: float = 10.0,
        max_request_bytes: int = 64 << 10,
    ) -> None:
        self.path, self.handler = path, handler
        self.max_request_bytes = max_request_bytes
        self.max_clients, self.max_per_uid, self.idle_timeout_s = max_clients, max_per_uid, idle_timeout_s
        self.refused = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        old_umask = os.umask(0o177)  # never world-writable, not even between bind and chmod
        try:
            self.sock.bind(path)
        finally:
            os.umask(old_umask)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        self.sock.listen(64)
        self.conns: dict[int, _Conn] = {}
        self._poller: zmq.Poller | None = None

    # -- poll-loop integration ---------------------------------------------------------
    def register(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.sock.fileno(), zmq.POLLIN)

    def owns(self, fd: int) -> bool:
        return fd == self.sock.fileno() or fd in self.conns

    def on_ready(self, fd: int, events: int) -> None:
        try:
            if fd == self.sock.fileno():
                self._accept()
            elif fd in self.conns:
                c = self.conns[fd]
                if events & zmq.POLLOUT:
                    self._flush(c)
                    if fd in self.conns and not c.outbuf:
                        self._serve(c)  # requests that arrived while the reply was pending
                if fd in self.conns and events & (zmq.POLLIN | zmq.POLLERR):
                    self._read(c)
        except Exception:
            log.exception("local socket: dropping a client after an error")
            if fd in self.conns:
                self._close(self.conns[fd])

    def reap_idle(self, now: float) -> None:
        for c in [c for c in self.conns.values() if now - c.last_s > self.idle_timeout_s]:
            self._close(c)

    def close(self) -> None:
        for c in list(self.conns.values()):
            self._close(c)
        if self._poller is not None:
            try:
                self._poller.unregister(self.sock.fileno())
            except KeyError:
                pass
        self.sock.close()

    # -- internals -------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):  # bounded: a flood of connects must not starve the caller's loop
            try:
                s, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("local socket: cannot accept: %s", e.strerror)
                    return
                raise
            s.setblocking(False)
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer = Peer(*struct.unpack("3i", creds))
            same_uid = sum(1 for c in self.conns.values() if c.peer.uid == peer.uid)
            if len(self.conns) >= self.max_clients or (peer.uid != 0 and same_uid >= self.max_per_uid):
                self.refused += 1
                if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                    log.warning(
                        "local socket: refused a client of uid %d (pid %d): %d connections open (%d refused so far)",
                        peer.uid,
                        peer.pid,
                        len(self.conns),
                        self.refused,
                    )
                s.close()
                continue
            c = _Conn(s, peer, time.monotonic())
            self.conns[s.fileno()] = c
            if self._poller is not None:
                self._poller.register(s.fileno(), zmq.POLLIN)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        if not data:
            self._close(c)
            return
        c.last_s = time.monotonic()
        c.inbuf += data
        self._serve(c)

    def _serve(self, c: _Conn) -> None:
        while not c.outbuf and len(c.inbuf) >= _LEN.size:
            n = _LEN.unpack_from(c.inbuf)[0]
            if n > self.max_request_bytes:
                log.warning("local socket: uid %d pid %d announced a %d-byte frame: closed", c.peer.uid, c.peer.pid, n)
                self._close(c)
                return
            if len(c.inbuf) < _LEN.size + n:
                return
            frame = bytes(c.inbuf[_LEN.size : _LEN.size + n])
            del c.inbuf[: _LEN.size + n]
            reply = self.handler(frame, c.peer)
            c.outbuf += _LEN.pack(len(reply)) + reply
            self._flush(c)
            if c.sock.fileno() not in self.conns:
                return

    def _flush(self, c: _Conn) -> None:
        try:
            sent = c.sock.send(c.outbuf)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(c)
            return
        del c.outbuf[:sent]
        if self._poller is not None:
            # Waiting for the client to read: stop reading its further requests meanwhile.
            self._poller.modify(c.sock.fileno(), zmq.POLLOUT if c.outbuf else zmq.POLLIN)

    def _close(self, c: _Conn) -> None:
        fd = c.sock.fileno()
        self.conns.pop(fd, None)
        if self._poller is not None and fd >= 0:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
        c.sock.close()


# ---- the rendezvous store's listening socket --------------------------------------------


def store_listen_fd(host: str, *, cluster: bool) -> tuple[int, int]:
    """A TCP listening socket on exactly `host`'s address, for torch's TCPStore
    (`master_listen_fd=`), which would otherwise listen on every interface. The
    store has no authentication, so it must be reachable only where peers are:
    loopback for a local job, the advertised job address under Slurm. Returns
    (fd, port); the fd is handed over (the caller's store owns it)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeError(f"cannot resolve the advertised host {host!r}: {e.strerror}") from None
    ip = addr[0]
    if cluster and (ip.startswith("127.") or ip == "::1"):
        # Other nodes could never connect to a loopback listener: a Debian-style
        # /etc/hosts maps the FQDN to 127.0.1.1. Listen everywhere, and say so.
        log.warning(
            "advertised host %s resolves to %s on this host: the rendezvous store listens on "
            "every interface; set RESILD_CONTROLLER_HOST to this host's job-network address",
            host,
            ip,
        )
        family, addr = socket.AF_INET, ("0.0.0.0", 0)
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(4096)
        port = s.getsockname()[1]
    except OSError:
        s.close()
        raise
    return s.detach(), port
