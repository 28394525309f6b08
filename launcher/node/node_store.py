"""The node process's half of the job's rendezvous: what its workers' group formation
asks of the store, served here when it concerns this node only, and thinned out before
it reaches the controller when it does not.

Workers with a relay send every STORE request to their node process (ipc, 0600 socket in
a 0700 directory: only the job's user reaches it), with a scope:

- "node": a group whose ranks all live on this node (at 8 GPUs a node, most groups of an
  epoch: the per-node gloo groups, TP and FSDP shard groups inside a node). Served by a
  `Rendezvous` of the node's own; the controller never hears of it. Each epoch's keys are
  under `resild/e<epoch>/`, and the two newest epochs are kept, as at the controller.
- "job": forwarded to the leading controller under an id of the node's own, its reply
  handed back under the worker's id. A `get` of a key for which a `get` is already in
  flight from this node is not forwarded again: the one reply answers every local asker
  (the NCCL world id: one get per node instead of one per rank). So is a `multi_get` of the
  same keys (gloo reads every member's address of a group so, each member the same list:
  one per node and group). This is exact for keys written once, which every key torch's
  group rendezvous reads with `get` or `multi_get` is (peer addresses, unique ids);
  counters are read with `add`, never coalesced.

Pure apart from the clock it is given: every method returns the replies to send (and the
request to forward), the node process sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resild.rendezvous import Rendezvous

Reply = tuple[bytes, dict[str, Any]]
FORWARD_GRACE_S = 2.0  # a forwarded request unanswered this long past its timeout is given up
DEFAULT_TIMEOUT_S = 60.0  # for a request that names none


@dataclass
class _Forwarded:
    askers: list[tuple[bytes, int]]  # (worker routing id, its request id)
    deadline: float
    key: tuple[str, ...] | None  # (op, its keys...) of a coalesced get or multi_get


@dataclass
class NodeStore:
    local: Rendezvous = field(default_factory=Rendezvous)
    forwarded: dict[int, _Forwarded] = field(default_factory=dict)  # by the node's request id
    gets: dict[tuple[str, ...], int] = field(default_factory=dict)  # (op, keys...) -> id of the one in flight
    _next_id: int = 0
    coalesced: int = 0  # gets answered by another asker's forward (for the bench and tests)

    def request(self, ident: bytes, body: dict[str, Any], now: float) -> tuple[list[Reply], dict[str, Any] | None]:
        """One worker's STORE (validated): (replies to send now, a body to forward or None)."""
        rid = int(body["id"])
        req = {k: v for k, v in body.items() if k not in ("scope", "node")}
        if body.get("scope") == "node":
            return self.local.handle(ident, req, now), None
        keys = list(req.get("keys") or [])
        op = req.get("op")
        key = (op, *keys) if (op == "get" and len(keys) == 1) or (op == "multi_get" and keys) else None  # coalescible
        if key is not None and (fid := self.gets.get(key)) is not None:
            self.forwarded[fid].askers.append((ident, rid))
            self.coalesced += 1
            return [], None
        timeout_s = float(req.get("timeout_s") or 0.0) or DEFAULT_TIMEOUT_S
        self._next_id += 1
        fid = self._next_id
        self.forwarded[fid] = _Forwarded([(ident, rid)], now + timeout_s + FORWARD_GRACE_S, key)
        if key is not None:
            self.gets[key] = fid
        return [], {**req, "id": fid, "timeout_s": timeout_s}

    def reply(self, body: dict[str, Any]) -> list[Reply]:
        """The controller's STORE_REPLY to a forward -> the same answer for each asker."""
        f = self._pop(int(body.get("id", -1)))
        if f is None:
            return []  # given up on, or from before a leader change
        return [(ident, {**body, "id": rid}) for ident, rid in f.askers]

    def expire(self, now: float) -> list[Reply]:
        """Local waits past their deadline, and forwards the controller never answered."""
        out = self.local.expire(now)
        for fid in [fid for fid, f in self.forwarded.items() if f.deadline <= now]:
            out += self._fail(fid, "no answer from the controller")
        return out

    def leader_changed(self) -> list[Reply]:
        """A new leader never saw the forwards in flight: each asker is told, and retries."""
        out: list[Reply] = []
        for fid in list(self.forwarded):
            out += self._fail(fid, "the controller changed during a store request")
        return out

    def next_deadline(self) -> float:
        return min([self.local.next_deadline, *(f.deadline for f in self.forwarded.values())])

    def _fail(self, fid: int, why: str) -> list[Reply]:
        f = self._pop(fid)
        return [] if f is None else [(ident, {"id": rid, "ok": False, "error": why}) for ident, rid in f.askers]

    def _pop(self, fid: int) -> _Forwarded | None:
        f = self.forwarded.pop(fid, None)
        if f is not None and f.key is not None and self.gets.get(f.key) == fid:
            del self.gets[f.key]
        return f
