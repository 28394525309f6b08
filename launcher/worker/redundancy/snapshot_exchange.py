"""Moving frozen snapshots between ranks: the background exchange after a commit,
and the fetch of a lost rank's snapshot at a rollback.

A snapshot travels as two point-to-point messages: a 7-integer header (step,
CRC, sizes, source) and the payload. The background exchange runs on its own
gloo group (host memory, even when training runs on NCCL), one thread per
snapshot, so a commit never waits for it; its waits are not counted as the
rank's collectives (a rank whose training thread hangs must still be named by
the hang detector, not excused by a snapshot transfer in flight).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from launcher.worker.redundancy.snapshot_store import HEADER_LEN, Frozen, SnapshotStore, holders, sources
from launcher.worker.transport.mac import Mac

log = logging.getLogger("resild.snapshots")

FETCH_TAG = 90  # the rollback fetch; the exchange uses 100 + 2k (header) and 101 + 2k (payload)


def send_frozen(pg: Any, f: Frozen, dst: int, tag: int, mac: Mac | None = None) -> tuple[list[Any], torch.Tensor]:
    """-> the two works, and the header tensor (it must outlive them). `mac`: the job's data
    key, which tags a copy of this rank's own the first time it is sent (a held copy keeps
    its owner's tag)."""
    h = f.header(mac)
    return [pg.send([h], dst, tag), pg.send([f.payload], dst, tag + 1)], h


def recv_frozen(pg: Any, src: int, tag: int, wait: Callable[[Any], None]) -> Frozen:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    wait(pg.recv([h], src, tag))
    f = Frozen.empty_from([int(x) for x in h.tolist()])
    wait(pg.recv([f.payload], src, tag + 1))
    return f


class Exchanger:
    """After a commit, send this rank's newest snapshot to its holders and take in the
    ones it holds for its sources, in a thread of its own. `busy()` feeds the commit
    vote; a recovery `abandon()`s the exchange in flight (its copies never land)."""

    def __init__(
        self,
        store: SnapshotStore,
        group: Any,
        rank: int,
        world_size: int,
        per_node: int,
        copies: int,
        mac: Mac | None = None,
    ) -> None:
        self.store, self.group, self.mac = store, group, mac
        self.to = holders(rank, world_size, per_node, copies)
        self.frm = sources(rank, world_size, per_node, copies)
        self._lock = threading.Lock()
        self._gen = 0
        self._thread: threading.Thread | None = None
        self.last_s = 0.0  # seconds the last completed exchange took
        self.failed: str | None = None

    def start(self, f: Frozen) -> None:
        self.failed = None
        pg = self.group.pg
        with self._lock:
            gen = self._gen
        t = threading.Thread(target=self._run, args=(f, pg, gen), name=f"resild-snapshot-{f.step}", daemon=True)
        self._thread = t
        t.start()

    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def abandon(self) -> None:
        """A recovery began: whatever is in flight belongs to a dead epoch."""
        with self._lock:
            self._gen += 1
        self._thread = None

    def _run(self, f: Frozen, pg: Any, gen: int) -> None:
        t0 = time.monotonic()
        try:
            copies = self._exchange(pg, f)
        except Exception as e:  # a peer died mid-transfer: the recovery deals with it
            self.failed = f"{type(e).__name__}: {e}"
            log.debug("snapshot exchange of step %d failed: %s", f.step, e)
            return
        with self._lock:
            if gen != self._gen:
                return
            for c in copies:
                self.store.keep_held(c)
            self.last_s = time.monotonic() - t0

    def _exchange(self, pg: Any, f: Frozen) -> list[Frozen]:
        if pg is None:
            raise RuntimeError("no snapshot group in this epoch")
        f.seal(self.mac)
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        for k, dst in enumerate(self.to, 1):
            w, h = send_frozen(pg, f, dst, 100 + 2 * k, self.mac)
            works += w
            keep.append(h)
        headers = []
        for k, src in enumerate(self.frm, 1):
            h = torch.zeros(HEADER_LEN, dtype=torch.int64)
            headers.append((k, src, h, pg.recv([h], src, 100 + 2 * k)))
        got = []
        for k, src, h, w in headers:
            w.wait()
            c = Frozen.empty_from([int(x) for x in h.tolist()])
            if c.src != src:
                raise RuntimeError(f"snapshot from rank {src} claims to be rank {c.src}'s")
            got.append((c, pg.recv([c.payload], src, 101 + 2 * k)))
        for _c, w in got:
            w.wait()
        for w in works:
            w.wait()
        for c, _ in got:
            if not c.authentic(self.mac):  # not from a rank of this job: never held
                raise RuntimeError(f"a snapshot copy said to be rank {c.src}'s step {c.step} failed its authentication")
        return [c for c, _ in got]
