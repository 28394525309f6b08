"""Restore by rolling every rank back to the newest peer-memory snapshot complete for
all: its own copy, or one fetched from a holder on another node
(launcher.worker.redundancy.rollback). The steps since are redone."""

from __future__ import annotations

import time

from launcher.worker.redundancy.rollback import rollback
from launcher.worker.redundancy.snapshot_cadence import SnapshotManager
from launcher.worker.redundancy.snapshot_store import NoSnapshot
from launcher.worker.sources.base import Need, Restored, Unavailable
from launcher.worker.sources.context import SourceContext
from launcher.worker.step_state import StepState
from launcher.worker.transport.state_transport import Received
from resild.events.schema import EventName, RestoreSource


class SnapshotSource:
    name = RestoreSource.SNAPSHOT

    def __init__(self, ctx: SourceContext, snap: SnapshotManager, copies: int, steps: StepState) -> None:
        self.ctx, self.snap, self.copies, self.steps = ctx, snap, copies, steps

    @classmethod
    def build(cls, ctx: SourceContext) -> SnapshotSource | None:
        red = ctx.redundancy
        if red is None or red.snap is None or red.steps is None:
            return None  # the job keeps no snapshots (--snapshot-copies 0, or replicas enough)
        return cls(ctx, red.snap, red.copies, red.steps)

    def restore(self, need: Need, why: str) -> Restored:
        c, snap, steps = self.ctx, self.snap, self.steps
        t0 = time.monotonic()
        try:
            step, frozen, plan, damaged = rollback(
                c.rec.groups["world"].pg,
                lambda w: c.rec.wait(w, untimed=True),
                snap.store,
                c.rank,
                c.world_size,
                need.newest,
                2 * (1 + self.copies) + 2,
                attempts=1 + self.copies,
                mac=c.rec.mac,
            )
        except NoSnapshot as e:
            raise Unavailable(str(e)) from None
        finally:
            for src, s in snap.store.corrupt_found:
                c.emit(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=c.rank, found="verify")
            snap.store.corrupt_found.clear()
        if c.rank == 0:
            for holder, src, s in damaged:
                c.emit(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=holder, found="transfer")
            c.emit(
                EventName.ROLLED_BACK, step=step, newest=need.newest, steps_redone=need.newest - step, fetches=len(plan)
            )
        live = c.protocol.receive_into  # a rollback writes the snapshot into the live state
        if frozen is not None:
            state, aux, written, landed = frozen.thaw_into(live(), need.landing)
            holder = next(f.holder for f in plan if f.src == c.rank)
            took = time.monotonic() - t0
            return Restored(
                step,
                Received(state, aux, frozen.nbytes, [holder], took, in_place=written, landed=landed),
                self.name,
            )
        if steps.holding and steps.step == step:
            return Restored(step, None, self.name)  # the live state is that step: only the aux rewinds
        own = snap.store.get(c.rank, step)
        assert own is not None
        state, aux, written, landed = own.thaw_into(live(), need.landing)
        took = time.monotonic() - t0
        return Restored(step, Received(state, aux, 0, [c.rank], took, in_place=written, landed=landed), self.name)

    def fresh_start(self) -> Restored | None:
        return None

    def ahead(self) -> None:
        pass  # a rollback thaws what every rank already holds
