"""When to snapshot, and what a commit and a recovery do to the snapshots.

A snapshot is due every `every` committed steps. It starts only when the
previous one is confirmed (the commit vote said every rank finished its
exchange), so at most one is in flight and every rank decides alike: the
decision uses only what the vote told all of them. A due snapshot that finds
the previous one unconfirmed is skipped, never queued: snapshots fall behind
instead of slowing the training loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.worker.redundancy.device_stager import DeviceStager
from launcher.worker.redundancy.snapshot_exchange import Exchanger
from launcher.worker.redundancy.snapshot_store import Frozen, SnapshotStore

FAILED = 1 << 20  # a rank's vote value when its exchange failed (any sum at or above: one failed)


@dataclass
class Cadence:
    """Pure bookkeeping of which step to snapshot next (identical on every rank)."""

    every: int
    last_started: int | None = None
    pending: int | None = None  # started, not yet confirmed by a vote

    def on_commit(self, step: int, confirmed: bool, failed: bool = False) -> tuple[int | None, bool]:
        """-> (the step just confirmed or None, start a snapshot of `step` now?). `failed`:
        some rank's exchange failed, so the pending snapshot will never be complete: drop
        it (the previous confirmed one stays) and take the next one when due."""
        done = None
        if self.pending is not None and confirmed:
            done, self.pending = self.pending, None
        elif failed:
            self.pending = None
        due = self.last_started is None or step - self.last_started >= self.every
        start = due and self.pending is None
        if start:
            self.pending = self.last_started = step
        return done, start

    def after_recovery(self, step: int) -> None:
        """Copies were lost with the failed node: snapshot at the first commit after `step`."""
        self.pending, self.last_started = None, step - self.every


class SnapshotManager:
    def __init__(
        self,
        store: SnapshotStore,
        exchanger: Exchanger,
        every: int,
        capture: Callable[[], tuple[Any, Any]],
        stager: DeviceStager | None = None,
    ) -> None:
        self.store, self.exchanger, self.capture = store, exchanger, capture
        self.stager = stager  # a GPU rank: pinned buffers filled on a side stream
        self.cadence = Cadence(max(1, int(every)))
        self.taken = self.skipped = 0
        self.capture_s = 0.0  # seconds spent copying on the training thread, all snapshots

    def vote_flag(self) -> int:
        """This rank's part of the commit vote: 0 its exchange is done, 1 still running,
        FAILED it failed (a peer vanished or timed out: those copies never arrive)."""
        if self.exchanger.busy():
            return 1
        return FAILED if self.exchanger.failed is not None else 0

    def after_commit(self, step: int, vote_sum: int) -> bool:
        """`vote_sum`: the sum of every rank's vote_flag() in this step's commit vote.
        (A commit hook: launcher.worker.commit.CommitHook.)"""
        c = self.cadence
        due = c.last_started is None or step - c.last_started >= c.every
        if vote_sum >= FAILED:
            self.exchanger.failed = None
        done, start = c.on_commit(step, confirmed=vote_sum == 0, failed=vote_sum >= FAILED)
        if done is not None:
            self.store.confirm(done)
        if start:
            t0 = time.monotonic()
            state, aux = self.capture()
            if self.stager is not None:
                busy = {x.payload.data_ptr() for x in self.store.own.values()}
                f = self.stager.capture(step, self.store.rank, state, aux, busy)
            else:
                f = Frozen.capture(step, self.store.rank, state, aux)
            self.store.keep_own(f)
            self.capture_s += time.monotonic() - t0
            self.taken += 1
            self.exchanger.start(f)
        elif due:
            self.skipped += 1  # the previous exchange is not confirmed yet: skipped, never queued
        return True

    def before_write(self) -> None:
        """The live state is about to change: a device copy still reading it must finish first."""
        if self.stager is not None:
            self.stager.before_write()

    def abandon(self) -> None:
        self.exchanger.abandon()
        self.exchanger.failed = None

    def after_recovery(self, step: int) -> None:
        self.store.drop_after(step)
        self.cadence.after_recovery(step)
