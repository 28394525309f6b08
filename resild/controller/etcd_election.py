"""Leader election among the controller replicas, by an etcd lease.

A replica campaigns with a transaction: create `<prefix>/leader` with its own lease if
the key is absent. The winner's term is the key's create revision (etcd's revision only
grows, across leaders and restarts of the cluster: a later leader always has a higher
term). The leader keeps its lease alive from a thread of its own; it counts itself the
leader only until the lease might have run out as etcd sees it (measured from the send
of the last keep-alive etcd answered, less a margin). When the lease is lost (expired,
revoked, or etcd unreachable for that long) the replica is deposed: it stops acting and
goes back to standing by, and may campaign again.

The decisions (is this replica still the leader at time t?) are the pure functions at
the top, tested with an injected clock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resild.controller.etcd_client import Etcd, EtcdError, b64

log = logging.getLogger("resild.etcd.election")

MARGIN_S = 0.25  # of the lease's TTL we never count on (clock rates, the answer's way back)


def lead_until(sent_s: float, ttl_s: float, margin_s: float = MARGIN_S) -> float:
    """Until when a replica may act as the leader after etcd renewed its lease for `ttl_s`
    in answer to a request sent at `sent_s` (monotonic): etcd's countdown began after the
    send, so ending before sent + ttl is safe."""
    return sent_s + max(0.0, ttl_s - margin_s)


def still_leader(now_s: float, term: int | None, valid_until_s: float) -> bool:
    return term is not None and now_s < valid_until_s


def lease_ttl_s(controller_timeout_s: float) -> int:
    """The leader's lease for a job whose nodes give up on a silent controller after
    `controller_timeout_s`: a dead leader is replaced within about TTL + 0.5 s (etcd checks
    expiry twice a second), well inside that; a longer TTL rides out more (an etcd member
    lost with its host costs etcd an election of its own, during which no lease is renewed)."""
    return max(1, min(10, int(controller_timeout_s // 4)))


def keepalive_period_s(ttl_s: float) -> float:
    """How often the leader renews: several times per TTL, so one lost answer costs nothing."""
    return max(0.05, ttl_s / 5)


@dataclass(frozen=True)
class LeaderInfo:
    """The leader key's value: who leads (for the standbys' logs and the tests)."""

    index: int
    pid: int
    lease: int

    def to_json(self) -> bytes:
        return json.dumps({"index": self.index, "pid": self.pid, "lease": self.lease}).encode()

    @staticmethod
    def from_json(raw: bytes) -> LeaderInfo:
        d = json.loads(raw)
        return LeaderInfo(int(d["index"]), int(d["pid"]), int(d["lease"]))


class Election:
    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        index: int,
        pid: int,
        ttl_s: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd, self.key, self.index, self.pid = etcd, f"{prefix}/leader", index, pid
        # The keep-alive thread's own connections: a journal write waiting on a slow member
        # must not hold a renewal back (and one HTTP session is not shared across threads).
        self._renewer = Etcd(etcd.target) if isinstance(etcd, Etcd) else etcd
        self.ttl_s = ttl_s
        self.clock = clock
        self.lease: int | None = None
        self.term: int | None = None  # the leader key's create revision while we lead
        self._valid_until_s = 0.0
        self._granted_ttl_s = float(ttl_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what the controller loop asks (every tick) ------------------------
    def is_leader(self) -> bool:
        with self._lock:
            return still_leader(self.clock(), self.term, self._valid_until_s)

    def holds(self) -> bool:
        """`is_leader`, asking etcd once when our own count has run out: a leader whose
        keep-alive thread was starved of the CPU for a moment still leads if etcd still
        has its lease (renewed by this very question). The controller loop asks this."""
        if self.is_leader():
            return True
        if self.term is None or not self.renew() or not self.is_leader():
            return False
        if self._thread is None or not self._thread.is_alive():
            self._start_keepalive()
        return True

    # ---- campaigning ---------------------------------------------------------
    def campaign(self) -> bool:
        """One try at leading: True once the leader key is ours (and the keep-alive runs).
        EtcdError when etcd cannot be asked (the caller tries again)."""
        if self.lease is None:
            sent = self.clock()
            self.lease, granted = self.etcd.grant(self.ttl_s)
            with self._lock:
                self._granted_ttl_s = float(granted)
                self._valid_until_s = lead_until(sent, granted)
        sent = self.clock()
        info = LeaderInfo(self.index, self.pid, self.lease)
        out = self.etcd.txn(
            [{"key": b64(self.key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            [{"request_put": {"key": b64(self.key), "value": b64(info.to_json()), "lease": self.lease}}],
            [{"request_range": {"key": b64(self.key)}}],
        )
        if out.get("succeeded"):
            term = int(out["header"]["revision"])  # the put's revision: the key's create revision
        else:
            kvs = _range_kvs(out)
            if not kvs or int(kvs[0].get("lease", 0)) != self.lease:
                # Another replica leads. Our lease goes: nobody keeps it alive while we
                # stand by, and the next campaign takes a fresh one.
                self._drop_lease()
                return False
            term = int(kvs[0]["create_revision"])  # ours already (an answer lost on the way)
        ttl = self.etcd.keepalive(self.lease)  # the lease must outlive the win
        if ttl <= 0:
            self._forget()
            return False
        with self._lock:
            self.term = term
            self._valid_until_s = lead_until(sent, ttl)
        self._start_keepalive()
        return True

    def leader(self) -> LeaderInfo | None:
        kv = self.etcd.get(self.key)
        try:
            return LeaderInfo.from_json(kv["value"]) if kv else None
        except (ValueError, KeyError, TypeError):
            return None

    def resign(self) -> None:
        """Stop leading (or campaigning): the keep-alive stops and the lease is revoked if
        etcd can be told (the next leader need not wait for it to expire)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.etcd.target.timeout_s * len(self.etcd.target.endpoints) + 1)
        self._thread = None
        self._drop_lease()

    def _drop_lease(self) -> None:
        lease = self.lease
        self._forget()
        if lease is not None:
            try:
                self.etcd.revoke(lease)
            except EtcdError as e:
                log.warning("could not revoke lease %x (it expires on its own): %s", lease, e)

    def _forget(self) -> None:
        with self._lock:
            self.term = None
            self.lease = None
            self._valid_until_s = 0.0

    # ---- keep-alive ----------------------------------------------------------
    def renew(self) -> bool:
        """One keep-alive; False once the lease is gone (we are no longer the leader)."""
        lease = self.lease
        if lease is None:
            return False
        sent = self.clock()
        try:
            ttl = self._renewer.keepalive(lease)
        except EtcdError as e:
            log.warning("lease keep-alive failed: %s", e)
            return self.is_leader()  # not lost yet: etcd's countdown may still run
        if ttl <= 0:
            log.error("lease %x is gone: no longer the leader", lease)
            with self._lock:
                self.term = None
                self._valid_until_s = 0.0
            return False
        with self._lock:
            self._valid_until_s = max(self._valid_until_s, lead_until(sent, ttl))
        return True

    def _start_keepalive(self) -> None:
        self._stop = threading.Event()
        stop = self._stop
        period = keepalive_period_s(self._granted_ttl_s)

        def run() -> None:
            while not stop.wait(period):
                if not self.renew() and not self.is_leader():
                    return

        self._thread = threading.Thread(target=run, name="etcd-lease-keepalive", daemon=True)
        self._thread.start()


def _range_kvs(txn: dict[str, Any]) -> list[dict[str, Any]]:
    for r in txn.get("responses") or []:
        if "response_range" in r:
            return list(r["response_range"].get("kvs") or [])
    return []
