"""The recovery loop of a training process: take new memberships until one epoch's groups
form, then agree on the newest committed step and restore the state (`RecoveryDriver`).

`recovery.RecoverySequence` carries out each step (retire, form, agree, replay); this
decides which run and when: a newer epoch at any point starts again, a collective failure
with no notice yet asks the controller for one, a membership without this rank ends the
process (fenced), and a new width has the job re-make its groups (`Host._resize`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from launcher.worker.old_backends import AbortStuck
from launcher.worker.recovery import Reformed
from launcher.worker.sources.base import Need, StateSource, Unavailable
from launcher.worker.sources.chain import Exhausted
from launcher.worker.sources.chain import restore as restore_state
from launcher.worker.transport.state_transport import describe
from resild.events.schema import EventName, RestoreSource
from resild.wire.exits import FENCED_EXIT

if TYPE_CHECKING:
    from launcher.worker.collective_check import CollectiveCheck
    from launcher.worker.commit import CommitProtocol
    from launcher.worker.links.controller import ControlLink
    from launcher.worker.recovery import RecoverySequence
    from launcher.worker.redundancy.coordinator import Redundancy
    from launcher.worker.resize import Resizer
    from launcher.worker.stable_group import Interrupts, StableGroup
    from launcher.worker.step_state import StepState
    from launcher.worker.train_state import TrainState
    from launcher.worker.transport.landing_pool import LandingPool
    from resild.membership import Membership
    from resild.wire.settings import WorkerTimeouts


class Host(Protocol):
    """What a recovery reads and changes on the job (runtime.Job): its place, which a
    recovery moves; what it restores, which a resize replaces; and the job's hooks."""

    rank: int
    world_size: int
    epoch: int
    state: TrainState | None
    redundancy: Redundancy | None
    _protocol: CommitProtocol | None
    _sources: list[StateSource]

    def _floor(self) -> int: ...

    def _landing(self) -> LandingPool | None: ...

    def _cannot_resize(self) -> str | None: ...

    def _resize(self, rank: int, m: Membership) -> None: ...

    def _check_shutdown(self) -> None: ...

    def _event(self, name: str, **fields: Any) -> None: ...

    def _progress(self, state: str, **extra: Any) -> None: ...

    def _fatal(self, why: str) -> NoReturn: ...


@dataclass
class RecoveryDriver:
    job: Host
    rec: RecoverySequence
    intr: Interrupts
    link: ControlLink | None  # None: a job run alone, which never recovers
    timeouts: WorkerTimeouts
    steps_state: StepState
    checks: CollectiveCheck
    resizer: Resizer
    node: str
    local_rank: int
    # The job's one-line error (runtime.ResilienceError: runtime imports this module).
    error: type[Exception]

    def form_until_stable(self, only: list[StableGroup]) -> None:
        try:
            self.form(self.job.epoch, only)
        except Reformed:
            self.recover()

    def form(self, epoch: int, groups: list[StableGroup]) -> float:
        """The recovery sequence's form(); an old communicator that never dies fails this
        rank in one line (its node is replaced)."""
        try:
            return self.rec.form(epoch, groups, self._ahead)
        except AbortStuck as e:
            raise self.error(str(e)) from None

    def _ahead(self) -> None:
        """While the groups form: what the restore sources can make ready (a survivor's
        state to send, walked and packed)."""
        if self.job.state is not None:
            for s in self.job._sources:
                try:
                    s.ahead()
                except Exception:
                    pass  # only ever ahead of time: the restore itself meets and reports the same

    def await_notice(self, why: str) -> None:
        """A collective failed with no new membership yet: only the controller knows.
        The report makes it probe every node at once instead of waiting for heartbeats."""
        self.job._progress("collective_failed", error=why[:300])
        link = self.link
        assert link is not None
        ok = link.wait(
            lambda: link.newer_epoch() or link.shutdown is not None,
            self.timeouts.notice_timeout_s,
        )
        self.job._check_shutdown()
        if not ok:
            raise self.error(f"collective failed ({why}) and no new membership came within the notice timeout")

    def recover(self) -> None:
        """Run the recovery sequence until one epoch completes it."""
        job, link = self.job, self.link
        assert link is not None
        if job.redundancy is not None:
            token = self.intr.begin_wait()  # it may wait on transfers to a peer not yet fenced: waiting, not hung
            try:
                job.redundancy.abandon()  # snapshot exchanges and checkpoint writes of the failed epoch
            finally:
                self.intr.done(token)
        resized: list[tuple[int, int]] = []  # (old width, new width) of each resize on the way
        while True:
            job._check_shutdown()
            if not link.newer_epoch():
                self.await_notice(self.intr.error or "collective failed")
            m = link.take()
            assert m is not None
            rank = m.rank_of(self.node, self.local_rank)
            if rank is None:
                os._exit(FENCED_EXIT)  # not in the new membership: we were fenced
            resize = rank != job.rank or m.world_size != job.world_size
            why = job._cannot_resize() if resize else None
            if resize and (why is not None or job.state is None):
                raise self.error(
                    f"membership epoch {m.epoch} moved rank {job.rank} to {rank} of {m.world_size}: "
                    f"this job cannot change width ({why or 'not attached yet'})"
                )
            job.epoch = m.epoch
            self.rec.retire()  # returns at once: the old backends abort while the new ones form
            self.intr.clear()
            if resize:
                widths = (job.world_size, m.world_size)
                job._resize(rank, m)
                resized.append(widths)
            if link.newer_epoch():
                continue
            t0 = time.monotonic()
            try:
                formed_s = self.form(m.epoch, list(self.rec.groups.values()))
                if job.redundancy is not None:
                    job.redundancy.formed()
                if job.rank == 0:
                    job._event(
                        EventName.GROUP_REFORMED,
                        seconds=round(formed_s, 4),
                        world_size=job.world_size,
                        abort_wait_s=round(self.rec.abort_wait_s, 4),
                    )
                if job.state is not None:
                    self.join(t0)
                if resized:
                    self.resizer.resized(job.rank, resized[0][0], job.world_size)
                return
            except Reformed:
                continue

    def join(self, t0: float | None = None) -> None:
        """Agree on the newest committed step; roll forward or restore the state from the
        first source that has it (launcher.worker.sources: a replica, else a rollback to
        snapshots, else a disk checkpoint), else stop the job in one line."""
        job = self.job
        protocol = job._protocol
        assert protocol is not None
        t0 = t0 or time.monotonic()
        floor = job._floor()
        ag = self.rec.agree(job.rank, job.world_size, self.steps_state.agreement_row(), floor)
        protocol.before_write()  # rolling forward or restoring writes the live state
        protocol.settle(ag, job.rank)  # roll forward or abandon; the agreed step is computed afresh
        back = job.redundancy.after_divergence(ag.rows) if job.redundancy is not None else None
        if back is not None:  # replicas diverged: every rank returned to their last agreed step
            floor = back  # the steps the controller saw committed since then are redone
            ag = self.rec.agree(job.rank, job.world_size, self.steps_state.agreement_row(), floor)
        landing = job._landing()
        try:
            done = restore_state(job._sources, Need(ag.target, floor, ag.steps, landing))
        except (Exhausted, Unavailable) as e:
            job._fatal(str(e))
        finally:
            self.rec.forget_prepared()
        if landing is not None:
            landing.clear()  # this rank holds its state now: the rest is memory no one needs
        target, got, source = done.step, done.got, done.source
        if not done.loaded:
            protocol.resume(got)
        if job.redundancy is not None:
            job.redundancy.after_join(target)
        if got is not None and got.sources != [job.rank]:  # not a restore of this rank's own snapshot
            # one write (not print's two): the ranks share one stderr pipe
            sys.stderr.write(f"resild: rank {job.rank} replayed {describe(got)} ({source.value})\n")
            job._event(
                EventName.STATE_REPLAYED,
                bytes=got.nbytes,
                seconds=round(got.seconds, 4),
                step=target,
                sources=got.sources,
                mb_per_s=round(got.nbytes / 1e6 / max(got.seconds, 1e-9), 1),
                source=source.value,
                # under the job's data key (launcher/worker/transport/mac.py); a disk
                # checkpoint has its own files' rules
                authenticated=(source is RestoreSource.SNAPSHOT and self.rec.mac is not None)
                or (source is RestoreSource.REPLICA and self.rec.replay_mac() is not None),
                in_place_bytes=got.in_place,
                landed_bytes=got.landed,
                prepared=got.ahead,  # its source walked and packed it while the groups formed
            )
        if job.epoch > 1:
            job._progress("joined")
            self.checks.arm("the first step after a recovery")
        if job.rank == 0 and job.epoch > 1:
            job._event(EventName.RESUMED, step=target, seconds=round(time.monotonic() - t0, 4), source=source.value)
