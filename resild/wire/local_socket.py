"""The node daemon's local status socket: a plain AF_UNIX stream socket
(`UnixServer`, `local_request`): length-prefixed protocol frames, the peer's
uid/pid from SO_PEERCRED, bounded clients, frames and idle time.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth

from resild.wire.protocol import MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Sequencer, decode, encode

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


def unix_path(endpoint: str) -> str | None:
    """The filesystem path of an ipc:// endpoint (or a bare path); None for anything else."""
    if endpoint.startswith("ipc://"):
        return endpoint[6:]
    return None if "://" in endpoint else endpoint


def local_request(
    endpoint: str,
    mtype: MsgType,
    body: dict[str, Any] | None = None,
    timeout_s: float = 3.0,
    ctx: zmq.SyncContext | None = None,
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
    __slots__ = ("sock", "peer", "inbuf", "outbuf", "last_s", "frame_start_s", "privileged")

    def __init__(self, sock: socket.socket, peer: Peer, now: float, privileged: bool) -> None:
        self.sock, self.peer, self.last_s = sock, peer, now
        self.frame_start_s: float | None = None  # first byte of the frame being received
        self.privileged = privileged
        self.inbuf = bytearray()
        self.outbuf = bytearray()

    def expired(self, now: float, timeout_s: float) -> bool:
        """Idle too long, or a frame begun too long ago: bytes dribbled into a frame
        never extend its deadline (one byte every few seconds held a slot forever)."""
        since = self.last_s if self.frame_start_s is None else self.frame_start_s
        return now - since > timeout_s


class UnixServer:
    """Request/reply over an AF_UNIX stream socket, driven by the owner's poll loop.

    Each request is a 4-byte big-endian length and one protocol frame; each gets one
    reply frame. Bounds, so no client can exhaust the server: at most `max_clients`
    connections of unprivileged peers, `max_per_uid` of them for one uid (excess
    connections are closed at once, so file descriptors never run out); root and the
    server's own uid have `max_privileged` connections of their own, outside those caps,
    so other users can never lock them out. Requests are at most `max_request_bytes`
    (the length is checked before anything is buffered); a connection idle for
    `idle_timeout_s`, or whose frame is not complete `idle_timeout_s` after its first
    byte, is closed; a client that does not read its reply is not read from until it does.
    `handler(frame, peer)` returns the reply frame and must not raise (an exception
    closes that connection only, and is logged)."""

    def __init__(
        self,
        path: str,
        handler: Callable[[bytes, Peer], bytes],
        *,
        mode: int = 0o660,
        gid: int | None = None,
        max_clients: int = 128,
        max_per_uid: int = 16,  # 8 uids to fill max_clients (4 did, at 32), and root keeps its slots
        max_privileged: int = 16,
        idle_timeout_s: float = 10.0,
        max_request_bytes: int = 64 << 10,
    ) -> None:
        self.path, self.handler = path, handler
        self.max_request_bytes = max_request_bytes
        self.max_clients, self.max_per_uid, self.idle_timeout_s = max_clients, max_per_uid, idle_timeout_s
        self.max_privileged = max_privileged
        self.privileged_uids = frozenset({0, os.geteuid()})
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
        for c in [c for c in self.conns.values() if c.expired(now, self.idle_timeout_s)]:
            self._close(c)

    def admits(self, peer: Peer) -> bool:
        """Whether one more connection of `peer` fits its caps (see the class doc)."""
        if peer.uid in self.privileged_uids:
            return sum(1 for c in self.conns.values() if c.privileged) < self.max_privileged
        others = [c for c in self.conns.values() if not c.privileged]
        same_uid = sum(1 for c in others if c.peer.uid == peer.uid)
        return len(others) < self.max_clients and same_uid < self.max_per_uid

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
            if not self.admits(peer):
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
            c = _Conn(s, peer, time.monotonic(), peer.uid in self.privileged_uids)
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
        if not c.inbuf:  # a new frame begins: its deadline runs from now
            c.frame_start_s = time.monotonic()
        c.inbuf += data
        self._serve(c)

    def _serve(self, c: _Conn) -> None:
        while not c.outbuf and len(c.inbuf) >= _LEN.size:
            n = _LEN.unpack_from(c.inbuf)[0]
            if n > self.max_request_bytes or n == 0:  # an empty frame asks nothing: it only held the slot
                log.warning("local socket: uid %d pid %d announced a %d-byte frame: closed", c.peer.uid, c.peer.pid, n)
                self._close(c)
                return
            if len(c.inbuf) < _LEN.size + n:
                return
            frame = bytes(c.inbuf[_LEN.size : _LEN.size + n])
            del c.inbuf[: _LEN.size + n]
            # A whole frame: the connection is active, and what follows is a new frame.
            c.last_s = time.monotonic()
            c.frame_start_s = c.last_s if c.inbuf else None
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
