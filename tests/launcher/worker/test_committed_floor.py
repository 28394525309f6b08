"""The committed floor a recovering worker holds its peers to: the one its epoch's
membership carries (node relay -> ControlLink, real ZeroMQ over ipc), never the
rendezvous store, which has no authentication (any local user can write it)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from launcher.node.relay import RelayServer
from launcher.worker.links.controller import ControlLink
from launcher.worker.runtime import Job
from launcher.worker.stable_group import Interrupts
from resild.membership import Membership
from resild.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(30)


class ForgedStore:
    """What a local attacker leaves in the store: a floor no rank can reach."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.reads += keys
        return True

    def get(self, key: str) -> bytes:
        self.reads.append(key)
        return b"1000000"


def _take(link: ControlLink, epoch: int) -> Membership:
    assert link.wait(lambda: link.pending is not None and link.pending.epoch >= epoch, 5.0), "no membership came"
    m = link.take()
    assert m is not None and m.epoch == epoch
    return m


def _pump_hello(srv: RelayServer) -> None:
    deadline = time.monotonic() + 5
    while not srv.workers and time.monotonic() < deadline:
        srv.sock.poll(20)
        while srv.recv() is not None:
            pass
    assert srv.workers, "the worker never said hello to its relay"


def test_a_recovering_worker_takes_its_floor_from_the_membership_and_never_reads_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = zmq.Context()
    srv = RelayServer(ctx, "n0", run_dir=str(tmp_path))
    monkeypatch.setenv("RESILD_RELAY", srv.endpoint)
    monkeypatch.setenv("RESILD_LOCAL_RANK", "0")
    # No controller listens there: everything comes from the node's relay, as it does in a job.
    link = ControlLink("tcp://127.0.0.1:9", None, "n0", 0, Interrupts(), lambda: (0, 1, 0)).start()
    try:
        _pump_hello(srv)
        m1 = Membership.initial(["n0", "n1"], 1)
        srv.set_membership(m1.view("n0"))
        _take(link, 1)
        m2 = m1.replace("n1", "s0").with_committed(41)
        srv.set_membership(m2.view("n0"))
        assert _take(link, 2).committed == 41 and link.current is not None and link.current.committed == 41

        job: Any = Job.__new__(Job)  # only what _floor reads: a recovering rank in epoch 2
        store = ForgedStore()
        job.solo, job.epoch, job.link, job._store_client = False, 2, link, lambda: store
        assert job._floor() == 41
        assert store.reads == []

        # A layout whose floor is not a step is refused; the link lives on and takes the next.
        srv.ch.send(MsgType.MEMBERSHIP, {**m2.bump().view("n0").to_dict(), "committed": -5}, to=srv.workers[0])
        time.sleep(0.2)
        assert link.pending is None and link._thread.is_alive()
        srv.set_membership(m2.bump().bump().view("n0"))
        assert _take(link, 4).committed == 41
    finally:
        link.close(flush_s=0.1)
        srv.close()
        ctx.destroy(linger=0)
