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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.worker.redundancy.device_stager import DeviceStager
from launcher.worker.redundancy.snapshot_budget import PROBE_EVERY, SnapshotMeter, Want, agreed, vote_terms
from launcher.worker.redundancy.snapshot_exchange import Exchanger
from launcher.worker.redundancy.snapshot_store import Frozen, SnapshotStore

AUTO_EVERY = 0  # --snapshot-every auto
FAILED = 1 << 20  # a rank's vote value when its exchange failed (any sum at or above: one failed)


@dataclass
class Cadence:
    """Pure bookkeeping of which step to snapshot next (identical on every rank)."""

    every: int
    last_started: int | None = None
    pending: int | None = None  # started, not yet confirmed by a vote
    force: bool = False  # after a recovery: at the next commit, whatever `every` says by then

    def due(self, step: int) -> bool:
        return self.force or self.last_started is None or step - self.last_started >= self.every

    def on_commit(self, step: int, confirmed: bool, failed: bool = False) -> tuple[int | None, bool]:
        """-> (the step just confirmed or None, start a snapshot of `step` now?). `failed`:
        some rank's exchange failed, so the pending snapshot will never be complete: drop
        it (the previous confirmed one stays) and take the next one when due."""
        done = None
        if self.pending is not None and confirmed:
            done, self.pending = self.pending, None
        elif failed:
            self.pending = None
        start = self.due(step) and self.pending is None
        if start:
            self.pending = self.last_started = step
            self.force = False
        return done, start

    def after_recovery(self, step: int) -> None:
        """Copies were lost with the failed node: snapshot at the first commit after `step`
        (a flag, not `step - every`: with --snapshot-every auto a spare's `every` is agreed
        only in that commit's vote)."""
        self.pending, self.last_started, self.force = None, step, True


class SnapshotManager:
    def __init__(
        self,
        store: SnapshotStore,
        exchanger: Exchanger,
        every: int,
        capture: Callable[[], tuple[Any, Any]],
        stager: DeviceStager | None = None,
        budget: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        on_cadence: Callable[[int, str], None] | None = None,
    ) -> None:
        """`every` 0: auto, the cadence that keeps the snapshots' measured cost under
        `budget` of a step, agreed in the commit vote (snapshot_budget)."""
        self.store, self.exchanger, self.capture = store, exchanger, capture
        self.stager = stager  # a GPU rank: pinned buffers filled on a side stream
        self.meter = SnapshotMeter(budget) if every == AUTO_EVERY else None
        self.cadence = Cadence(PROBE_EVERY if self.meter is not None else max(1, int(every)))
        self.clock = clock
        self.taken = self.skipped = 0
        self.capture_s = 0.0  # seconds spent copying on the training thread, all snapshots
        self.want: Want | None = None  # auto: what this rank voted for last
        self.since_join: deque[int] = deque(maxlen=64)  # the steps snapshotted since the last recovery
        self.on_cadence = on_cadence  # auto: told each new agreed cadence, and this rank's reason

    # ---- --snapshot-every auto: extra terms of the commit vote (CommitProtocol.tallies) ----
    def vote_terms(self) -> list[int]:
        if self.meter is None:
            return []
        self.want = self.meter.want()
        return vote_terms(self.want.every)

    def voted(self, sums: list[int]) -> None:
        """Every rank sees the same sums: the cadence is the same everywhere from this step."""
        if self.meter is not None:
            every = agreed(sums)
            if every is not None and every != self.cadence.every:
                self.cadence.every = every
                if self.on_cadence is not None:
                    mine = self.want
                    why = mine.reason if mine is not None and mine.every == every else "another rank's measure"
                    self.on_cadence(every, why)

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
        due = c.due(step)
        if vote_sum >= FAILED:
            self.exchanger.failed = None
        done, start = c.on_commit(step, confirmed=vote_sum == 0, failed=vote_sum >= FAILED)
        if done is not None:
            self.store.confirm(done)
        if self.meter is not None:
            if vote_sum >= FAILED:
                self.meter.interrupted()  # the window's snapshot never completes: no cost to learn
            self.meter.commit(self.clock(), confirmed=done is not None, started=start)
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
            self.since_join.append(step)
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
        self.since_join.clear()
        if self.meter is not None:
            self.meter.interrupted()
