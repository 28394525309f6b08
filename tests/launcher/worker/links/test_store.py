"""The worker's store over the controller's rendezvous keys: real gloo groups form
through it (every call a request, a get of a key not yet set parked until it is)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from launcher.node.node_store import NodeStore
from launcher.worker.links.store import LinkStore
from launcher.worker.torch_private import GLOO_STORE_V2, backend_group, gloo_batched_reads
from resild.rendezvous import Rendezvous

pytestmark = pytest.mark.timeout(60)


class Loopback:
    """The controller's side in-process: requests handled by one Rendezvous, replies
    delivered to the waiting callers by id (what ControlLink.request does over CURVE)."""

    def __init__(self) -> None:
        self.rdv = Rendezvous()
        self.lock = threading.Lock()
        self.slots: dict[int, list[Any]] = {}
        self.n = 0
        self.ops: list[str] = []

    def request(self, body: dict[str, Any], timeout_s: float, node_local: bool = False) -> dict[str, Any]:
        slot: list[Any] = [threading.Event(), None]
        with self.lock:
            self.n += 1
            rid = self.n
            self.slots[rid] = slot
            self.ops.append(body["op"])
            for _, reply in self.rdv.handle(b"w", {"id": rid, "timeout_s": timeout_s, **body}, time.monotonic()):
                got = self.slots.pop(int(reply["id"]))
                got[1] = reply
                got[0].set()
        assert slot[0].wait(timeout_s)
        reply: dict[str, Any] = slot[1]
        return reply


@pytest.mark.parametrize("v2", ["1", "0"])
def test_a_gloo_group_forms_through_the_link_store_and_runs_a_collective(
    v2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GLOO_STORE_V2, v2)  # read by gloo (getenv) at each formation
    lb = Loopback()
    stores = [LinkStore(lb.request, 20.0) for _ in range(3)]  # referenced: torch calls them from C++
    groups: list[Any] = [None] * 3

    def form(r: int) -> None:
        pfx = torch.distributed.PrefixStore("resild/e1/world/", stores[r])
        groups[r] = backend_group("gloo", pfx, r, 3, timedelta(seconds=20), "127.0.0.1")

    threads = [threading.Thread(target=form, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups)
    if v2 == "1":  # gloo's batched rendezvous: per rank its own address set, then every member's
        assert sorted(lb.ops) == ["multi_get"] * 3 + ["set"] * 3
    else:  # a wait and a get per member, its own included: 2W + 1 requests per rank
        assert sorted(lb.ops) == ["get"] * 9 + ["set"] * 3 + ["wait"] * 9
    assert all(k.startswith("resild/e1/world/") for k in lb.rdv.kv)
    ts = [torch.full((2,), float(r)) for r in range(3)]
    works = [g.allreduce([t]) for g, t in zip(groups, ts)]
    for w in works:
        w.wait()
    assert all(torch.equal(t, torch.full((2,), 3.0)) for t in ts)


def test_a_refused_request_raises_in_the_caller() -> None:
    lb = Loopback()
    store = LinkStore(lb.request, 5.0)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 4) == 4 and store.check(["k", "n"])
    with pytest.raises(RuntimeError, match="limit"):
        store.set("big", b"x" * (1 << 20))


def test_a_multi_get_too_large_for_one_reply_or_one_request_is_asked_in_parts() -> None:
    from launcher.worker.links.store import MAX_KEYS
    from resild.rendezvous import MAX_REPLY_VALUES_CHARS

    lb = Loopback()
    store = LinkStore(lb.request, 5.0)
    big = [bytes([i]) * (MAX_REPLY_VALUES_CHARS // 3) for i in range(4)]  # 4/9 of a reply each, in base64
    for i, v in enumerate(big):
        store.set(f"big{i}", v)
    lb.ops.clear()
    assert store.multi_get([f"big{i}" for i in range(4)]) == big
    assert lb.ops == ["multi_get"] * 2  # two values fit a reply: the other two asked for again
    keys = [f"k{i}" for i in range(MAX_KEYS * 2 + 1)]
    for k in keys:
        store.set(k, k.encode())
    lb.ops.clear()
    assert store.multi_get(keys) == [k.encode() for k in keys]
    assert lb.ops == ["multi_get"] * 3


class ThroughNode:
    """Workers -> their node process's NodeStore -> the controller's Rendezvous, in-process
    (what RelayClient, NodeProcess and ControlLink carry over ipc and CURVE)."""

    def __init__(self) -> None:
        self.node, self.controller = NodeStore(), Rendezvous()
        self.lock = threading.Lock()
        self.slots: dict[tuple[bytes, int], list[Any]] = {}
        self.n = 0
        self.to_controller: list[str] = []

    def _deliver(self, replies: list[tuple[bytes, dict[str, Any]]]) -> None:
        for ident, reply in replies:
            got = self.slots.pop((ident, int(reply["id"])))
            got[1] = reply
            got[0].set()

    def request(self, body: dict[str, Any], timeout_s: float, node_local: bool = False) -> dict[str, Any]:
        slot: list[Any] = [threading.Event(), None]
        ident = threading.current_thread().name.encode()  # one "worker" per forming thread
        with self.lock:
            self.n += 1
            rid = self.n
            self.slots[(ident, rid)] = slot
            scoped = {"id": rid, "timeout_s": timeout_s, "scope": "node" if node_local else "job", **body}
            replies, fwd = self.node.request(ident, scoped, time.monotonic())
            self._deliver(replies)
            if fwd is not None:
                self.to_controller.append(fwd["keys"][0] if fwd.get("keys") else fwd["op"])
                for _, reply in self.controller.handle(b"node", fwd, time.monotonic()):
                    self._deliver(self.node.reply(reply))
        assert slot[0].wait(timeout_s)
        reply: dict[str, Any] = slot[1]
        return reply


def test_a_node_local_group_forms_on_the_node_and_a_job_group_through_the_controller() -> None:
    tn = ThroughNode()
    local = [LinkStore(tn.request, 20.0, node_local=True) for _ in range(2)]
    job = [LinkStore(tn.request, 20.0) for _ in range(2)]
    groups: dict[tuple[str, int], Any] = {}

    def form(label: str, r: int, store: LinkStore) -> None:
        pfx = torch.distributed.PrefixStore(f"resild/e1/{label}/", store)
        groups[(label, r)] = backend_group("gloo", pfx, r, 2, timedelta(seconds=20), "127.0.0.1")

    threads = [
        threading.Thread(target=form, args=(label, r, stores[r]), name=f"{label}{r}")
        for label, stores in (("shard", local), ("world", job))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(groups) == 4
    assert tn.node.local.kv and all(k.startswith("resild/e1/shard/") for k in tn.node.local.kv)
    assert tn.to_controller and all(k.startswith("resild/e1/world/") for k in tn.to_controller)
    assert all(k.startswith("resild/e1/world/") for k in tn.controller.kv)
    for label in ("shard", "world"):
        ts = [torch.full((2,), float(r + 1)) for r in range(2)]
        for w in [groups[(label, r)].allreduce([ts[r]]) for r in range(2)]:
            w.wait()
        assert all(torch.equal(t, torch.full((2,), 3.0)) for t in ts)


def test_workers_turn_gloos_batched_reads_on_unless_the_job_says_otherwise() -> None:
    env: dict[str, str] = {}
    assert gloo_batched_reads(env) and env[GLOO_STORE_V2] == "1"
    off = {GLOO_STORE_V2: "0"}
    assert not gloo_batched_reads(off) and off[GLOO_STORE_V2] == "0"  # the user's choice stands
