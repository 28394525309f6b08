"""Adversarial tests of the node daemon's status socket (UnixServer, audit findings):
bytes dribbled into a frame kept a connection open forever, and four uids holding
their per-uid share of connections locked root out."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from resild.wire.local_socket import Peer, UnixServer, local_request
from resild.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(60)


# -- the status socket: slow frames, per-uid caps, root's slot ----------------------------


@contextlib.contextmanager
def serving(server: UnixServer) -> Iterator[UnixServer]:
    """The daemon's poll loop, for a bare UnixServer."""
    poller = zmq.Poller()
    server.register(poller)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for fd, ev in poller.poll(20):
                if isinstance(fd, int) and server.owns(fd):
                    server.on_ready(fd, ev)
            server.reap_idle(time.monotonic())

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield server
    finally:
        stop.set()
        t.join(2)
        server.close()


def _echo(frame: bytes, peer: Peer) -> bytes:
    return frame


def test_dribbled_bytes_do_not_keep_a_connection_open(public_dir: Path) -> None:
    """One byte every 3 s reset the idle timer forever: the deadline now runs from the
    first byte of a frame."""
    with serving(UnixServer(str(public_dir / "u.sock"), _echo, mode=0o666, idle_timeout_s=0.5)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(public_dir / "u.sock"))
            s.settimeout(0.1)
            t0 = time.monotonic()
            closed_after = None
            header = struct.pack("!I", 1000)
            for i in range(30):  # 3 s of dribbling, one byte per 0.1 s
                try:
                    s.sendall(header[i : i + 1] if i < 4 else b"x")
                    if s.recv(10) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
            assert closed_after is not None and closed_after < 1.5, closed_after


def test_empty_frames_do_not_keep_a_connection_open(public_dir: Path) -> None:
    """An empty frame every few seconds counted as a request and held a slot for as long as its
    sender liked (issue 39, finding 5): it asks nothing, and closes the connection."""
    with serving(UnixServer(str(public_dir / "e.sock"), _echo, mode=0o666, idle_timeout_s=0.5)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(public_dir / "e.sock"))
            s.settimeout(2.0)
            s.sendall(struct.pack("!I", 0))
            assert s.recv(10) == b""  # closed at once, not answered


def _hold_as(uid: int, path: str, n: int) -> tuple[int, int, int]:
    """Fork a child that becomes `uid`, opens n connections to path and holds them
    until its pipe closes. Returns (pid, connections it got, pipe fd to close)."""
    r_ready, w_ready = os.pipe()
    r_hold, w_hold = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r_ready)
            os.close(w_hold)
            os.setgid(uid)
            os.setuid(uid)
            held = []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                held.append(s)
            time.sleep(0.3)  # the server has accepted or refused each by now
            alive = 0
            for s in held:
                s.setblocking(False)
                try:
                    alive += s.recv(1) != b""
                except BlockingIOError:
                    alive += 1
                except OSError:
                    pass
            os.write(w_ready, bytes([alive]))
            os.read(r_hold, 1)  # until the parent lets go
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w_ready)
    os.close(r_hold)
    got = os.read(r_ready, 1)
    os.close(r_ready)
    return pid, (got[0] if got else -1), w_hold


def _release(children: list[tuple[int, int, int]]) -> None:
    # Every pipe first: a later child holds copies of the earlier children's pipes.
    for _, _, w in children:
        os.close(w)
    for pid, _, _ in children:
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_other_uids_cannot_lock_root_out_of_the_status_socket(public_dir: Path) -> None:
    """Four uids holding max_per_uid connections each filled the global cap: root was
    refused. Root (and the daemon's own uid) now has slots outside the global cap, and
    its own connections do not count against the others'."""
    path = str(public_dir / "u.sock")
    srv = UnixServer(path, _echo, mode=0o666, max_clients=4, max_per_uid=2, idle_timeout_s=30)
    with serving(srv):
        mine = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for s in mine:
            s.connect(path)
        time.sleep(0.2)
        children = []
        try:
            children.append(_hold_as(65534, path, 3))
            children.append(_hold_as(65533, path, 3))
            # Each uid got its per-uid share, not more; root's two did not count.
            assert [c[1] for c in children] == [2, 2], [c[1] for c in children]
            rep = local_request(f"ipc://{path}", MsgType.STATUS, timeout_s=2.0)
            assert rep is not None and rep.type is MsgType.STATUS, "root was locked out"
        finally:
            _release(children)
            for s in mine:
                s.close()
