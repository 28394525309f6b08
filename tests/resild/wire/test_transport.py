"""Transport pieces that need no controller: per-node key directories under Slurm,
the rendezvous store's listening address, the daemon's unix socket server."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from launcher.run.slurm_backend import per_node_keys
from resild.wire.keys import generate_keys
from resild.wire.local_socket import Peer, UnixServer, local_request
from resild.wire.protocol import MsgType, Sequencer, decode, encode
from resild.wire.store import listen_address

pytestmark = pytest.mark.timeout(60)


def test_each_slurm_node_gets_its_own_key_directory(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    node_cmd = [
        sys.executable,
        "-c",
        "import sys; print(sys.argv[1:])",
        "--controller",
        "tcp://h:1",
        "--keys",
        str(keys.path),
        "--nproc",
        "2",
        "--",
        "train.py",
        "--keys",
        "user-arg",
    ]
    argv = per_node_keys(node_cmd, ["gpu-a", "gpu-b"])
    assert sorted(p.name for p in (keys.path / "nodes").iterdir()) == ["gpu-a", "gpu-b"]
    assert sorted(p.stem for p in keys.authorized.iterdir()) == ["client", "gpu-a", "gpu-b"]
    out = subprocess.run(
        argv, env=dict(os.environ, SLURMD_NODENAME="gpu-b"), capture_output=True, text=True, timeout=30
    ).stdout
    # Only the launcher's --keys changes; the training command's own arguments do not.
    assert f"'--keys', '{keys.path}/nodes/gpu-b'" in out and "'--keys', 'user-arg'" in out


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "client", "-x"])
def test_node_names_that_cannot_name_a_key(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        generate_keys(tmp_path / "k", nodes=[bad])


def _listening(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def test_a_service_listens_on_the_advertised_address_only() -> None:
    assert listen_address("127.0.0.1", cluster=False, what="x")[1] == "127.0.0.1"


def test_a_loopback_name_in_cluster_mode_listens_everywhere_with_a_warning(caplog) -> None:
    assert listen_address("localhost", cluster=True, what="the Raft port")[1] == "0.0.0.0"
    assert "resolves to" in caplog.text and "the Raft port" in caplog.text


def test_unix_server_request_reply_and_peer(tmp_path: Path) -> None:
    seen: list[Peer] = []

    def handler(frame: bytes, peer: Peer) -> bytes:
        seen.append(peer)
        return encode(Sequencer("srv").make(MsgType.STATUS_REPLY, {"got": decode(frame).type.value}))

    srv = UnixServer(str(tmp_path / "u.sock"), handler, mode=0o600)
    poller = zmq.Poller()
    srv.register(poller)
    assert (tmp_path / "u.sock").stat().st_mode & 0o777 == 0o600
    import threading

    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for fd, ev in poller.poll(50):
                srv.on_ready(fd, ev)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        rep = local_request(f"ipc://{tmp_path}/u.sock", MsgType.STATUS)
        assert rep is not None and rep.body == {"got": "status"}
        assert seen[0].pid == os.getpid() and seen[0].uid == os.getuid()
        assert local_request("tcp://127.0.0.1:1", MsgType.STATUS) is None  # local sockets only
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # oversized announcement: closed
            s.connect(str(tmp_path / "u.sock"))
            s.sendall(struct.pack("!I", 1 << 30))
            s.settimeout(2)
            assert s.recv(10) == b""
    finally:
        stop.set()
        t.join(2)
        srv.close()
