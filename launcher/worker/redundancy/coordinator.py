"""Redundancy beyond replicas, one part behind the `Job` facade: peer-memory snapshots
and rollback, resild's own disk checkpoints, and replicas' fingerprints.

The facade calls it at fixed points of the step and the recovery:

  attach        -> setup()              groups of their own, formed like the mesh's
  commit        -> before_write(), after_commit()   (the vote itself carries the
                   snapshot exchange's state; see snapshot_manager)
  recovery      -> abandon() at the start, formed() once the epoch's groups exist,
                   before_write() before the live state changes, without_replica()
                   when replay has no source, after_join() at the end
  end of job    -> before_done()

Order of sources when a lost rank's state has no live replica: a snapshot rollback,
then the newest complete disk checkpoint, then a one-line stop.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

import resild.wire.env as resild_env
from launcher.worker.commit import CommitProtocol
from launcher.worker.recovery import Recovery, Reformed
from launcher.worker.redundancy import checkpoint_faults
from launcher.worker.redundancy.checkpoint_cadence import Action, CheckpointCadence, flag
from launcher.worker.redundancy.device_stager import DeviceStager
from launcher.worker.redundancy.disk_checkpoint import DiskCheckpointer
from launcher.worker.redundancy.fingerprint import fingerprint, judge
from launcher.worker.redundancy.rollback import rollback
from launcher.worker.redundancy.snapshot_cadence import SnapshotManager
from launcher.worker.redundancy.snapshot_exchange import Exchanger
from launcher.worker.redundancy.snapshot_store import (
    NoSnapshot,
    PlacementError,
    SnapshotStore,
    check_placement,
)
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.stable_group import StableGroup
from launcher.worker.step_state import StepState
from launcher.worker.train_state import TrainState
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.state_transport import Received
from resild.events.schema import EventName
from resild.wire.settings import WorkerRedundancy


class RedundancyError(RuntimeError):
    """A setting the job cannot honour (the message names the fix)."""


# A save's collectives wait for the slowest rank's write: an hour is a slow file system,
# beyond it a hung one. Only the checkpoint's writer thread uses the group, and a
# recovery releases it at once (Interrupts.fail), so a long timeout holds nobody up.
CHECKPOINT_GROUP_TIMEOUT_S = 3600.0


class Redundancy:
    def __init__(
        self,
        settings: WorkerRedundancy,
        rank: int,
        world_size: int,
        per_node: int,
        device: torch.device,
        rec: Recovery,
        emit: Callable[..., None],
        fatal: Callable[[str], NoReturn],
    ) -> None:
        self.settings, self.rank, self.world_size, self.per_node = settings, rank, world_size, per_node
        self.device, self.rec, self.emit, self.fatal = device, rec, emit, fatal
        self.snap: SnapshotManager | None = None
        self.ckpt: DiskCheckpointer | None = None
        self.copies = 0
        self._ckpt_group: StableGroup | None = None
        self.cadence: CheckpointCadence | None = None
        self._protocol: CommitProtocol | None = None
        self.state: TrainState | None = None
        self.steps: StepState | None = None
        self._live: Callable[[], Any] = lambda: None  # the live state a rollback may write (setup)

    # ---- set-up ----------------------------------------------------------------------
    def setup(
        self,
        state: TrainState,
        steps: StepState,
        protocol: CommitProtocol,
        replicas: ReplicaMap,
        new_group: Callable[[str, float | None], StableGroup],
    ) -> None:
        """`new_group(label, timeout_s)`: a gloo StableGroup of every rank, registered and formed."""
        self.state, self.steps, self._protocol = state, steps, protocol
        self._live = protocol.receive_into  # a rollback writes the snapshot into the live state
        self._setup_snapshots(protocol, replicas, new_group)
        self._setup_checkpoints(new_group)

    def _setup_snapshots(
        self, protocol: CommitProtocol, replicas: ReplicaMap, new_group: Callable[[str, float | None], StableGroup]
    ) -> None:
        has_replicas = all(len(g) > 1 for g in replicas.groups)
        nodes = self.world_size // self.per_node
        copies = self.settings.copies(has_replicas, nodes)
        if copies <= 0:
            if not has_replicas and self.rank == 0:
                asked = self.settings.snapshot_copies
                print(
                    "resild: no rank's state has a replica and no snapshot copies are kept "
                    f"(--snapshot-copies {asked if asked >= 0 else 'auto'}, {nodes} node(s)): "
                    "losing a node will stop the job",
                    file=sys.stderr,
                    flush=True,
                )
            return
        try:
            check_placement(self.world_size, self.per_node, copies)
        except PlacementError as e:
            raise RedundancyError(str(e)) from None
        g = new_group("resild-snapshot", None)
        store = SnapshotStore(self.rank)
        exchanger = Exchanger(store, g, self.rank, self.world_size, self.per_node, copies)
        stager = DeviceStager(self.device) if self.device.type == "cuda" else None
        self.snap = SnapshotManager(store, exchanger, self.settings.snapshot_every, protocol.snapshot, stager)
        self.copies = copies
        protocol.snap = self.snap

    def _setup_checkpoints(self, new_group: Callable[[str, float | None], StableGroup]) -> None:
        """DCP's collectives run in the writer thread: a group of their own. A save starts
        when the commit vote says no rank is writing (checkpoint_cadence)."""
        s = self.settings
        if not s.checkpoint_dir:
            return
        try:
            faults = checkpoint_faults.from_env()
        except checkpoint_faults.CheckpointFaultError as e:
            raise RedundancyError(str(e)) from None
        g = self._ckpt_group = new_group("resild-checkpoint", CHECKPOINT_GROUP_TIMEOUT_S)
        ck = self.ckpt = DiskCheckpointer(
            Path(s.checkpoint_dir),
            s.checkpoint_every,
            self.rank,
            self.world_size,
            g,
            keep=2,
            intr=g._intr,
            faults=checkpoint_faults.Faults(faults, self.rank, os.environ.get(resild_env.NODE.name, ""))
            if faults
            else None,
        )
        self.cadence = CheckpointCadence(s.checkpoint_every)
        # The job's epoch failing releases the checkpoint group too, at once: a load on the
        # training thread must not wait out the group's hour-long timeout for a dead peer.
        self.rec.intr.on_fail.append(self._abandon_checkpoint)
        if self._protocol is not None:
            self._protocol.ckpt_flag = lambda: flag(ck.busy(), ck.broken())

    # ---- the step -----------------------------------------------------------------------
    def before_write(self) -> None:
        """The live state is about to change: a device copy still reading it finishes first."""
        if self.snap is not None:
            self.snap.before_write()

    def after_commit(self, step: int, replicas: Callable[[], ReplicaMap], group: StableGroup) -> None:
        every = self.settings.fingerprint_every
        clean = True
        if every and step % every == 0:
            clean = self._compare_replicas(step, replicas(), group)
        if self.ckpt is not None and clean:  # every rank has the verdict: none saves a diverged step
            self._checkpoint(step)

    def _checkpoint(self, step: int) -> None:
        """Start a due save if the vote said no rank is writing; report how saves ended.
        Never waits: a slow or hung file system defers checkpoints, never training."""
        ck, cadence, protocol = self.ckpt, self.cadence, self._protocol
        assert ck is not None and cadence is not None and protocol is not None
        assert self.state is not None and self.steps is not None
        self._report_saves(ck)
        d = cadence.on_commit(step, protocol.ckpt_writers)
        if d.action is Action.SAVE:
            ck.save(step, self.state, self.steps.committed_aux)
        elif d.first and self.rank == 0:
            self.emit(EventName.CHECKPOINT_DEFERRED, step=step, due=cadence.pending, reason=d.reason)

    def _report_saves(self, ck: DiskCheckpointer) -> None:
        """Rank 0 says how each save ended: every rank's ends alike (DCP gathers a rank's
        failure to all, and the COMPLETE confirmation is an all-reduce)."""
        for o in ck.take_outcomes():
            if self.rank != 0:
                continue
            if o.result == "saved":
                self.emit(EventName.CHECKPOINT_SAVED, step=o.step, seconds=round(o.seconds, 4), bytes=o.nbytes)
            else:
                abandoned = o.result == "abandoned"
                self.emit(
                    EventName.CHECKPOINT_FAILED,
                    step=o.step,
                    seconds=round(o.seconds, 4),
                    abandoned=abandoned,
                    error=o.error,
                )

    def corrupt(self) -> None:
        """Fault injection: this node's memory damages every snapshot copy it holds."""
        if self.snap is not None:
            self.snap.store.corrupt_now()

    def nudge(self) -> None:
        """Fault injection: what a GPU computing wrong numbers leaves behind."""
        assert self.state is not None
        p = next(iter(self.state.model.parameters()))
        with torch.no_grad():
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] += 1e-3

    def _compare_replicas(self, step: int, replicas: ReplicaMap, group: StableGroup) -> bool:
        """Every rank's state fingerprint in one all-reduce; a rank its replicas outvote
        leaves (its node is replaced and the state replayed from them). -> replicas agree."""
        assert self.state is not None
        vals = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        vals[self.rank] = fingerprint(self.state.snapshot(step))
        group.allreduce([vals]).wait()
        values = vals.cpu().tolist()  # on NCCL the read is what waits: the error is checked after it
        if group._intr.error is not None:
            return True  # the epoch is failing: the next vote finds out
        verdict = judge(values, replicas.groups)
        if verdict.clean:
            return True
        if self.rank == 0:
            self.emit(
                EventName.REPLICA_DIVERGED,
                step=step,
                odd=list(verdict.odd),
                undecided=[list(g) for g in verdict.undecided],
            )
        if verdict.undecided:
            self.fatal(
                f"replicas {[list(g) for g in verdict.undecided]} hold different state at step {step} and no "
                "majority says which is right: a faulty device; restart from a checkpoint"
            )
        if self.rank in verdict.odd:
            raise RuntimeError(
                f"resild: rank {self.rank}'s state diverged from its replicas at step {step} (fingerprints "
                "differ): a faulty device; this node leaves and a spare takes its ranks"
            )
        return False  # the odd ranks leave; the rest wait for the recovery that follows

    # ---- recovery -----------------------------------------------------------------------
    def abandon(self) -> None:
        """A recovery begins: snapshot exchanges and checkpoint writes in flight belong to
        the failed epoch (the checkpoint's collectives are released)."""
        if self.snap is not None:
            self.snap.abandon()
        self._abandon_checkpoint()

    def _abandon_checkpoint(self) -> None:
        """Never blocks (also an `Interrupts.on_fail` hook of the job's epoch)."""
        if self.ckpt is not None and self._ckpt_group is not None:
            self.ckpt.abandon()
            self._ckpt_group._intr.fail("a new epoch")

    def formed(self) -> None:
        """The new epoch's groups exist: a new generation, the abandoned save never completes."""
        if self._ckpt_group is not None:
            self._ckpt_group._intr.clear()
        if self.cadence is not None:
            self.cadence.after_recovery()

    def without_replica(
        self, newest: int, why: str, landing: LandingPool | None = None
    ) -> tuple[int, Received | None, str]:
        """No replica holds some lost rank's state: roll back to peer-memory snapshots,
        else load resild's newest disk checkpoint, else stop. `landing`: host memory a spare
        touched for what has no live home (launcher.worker.transport.landing_pool)."""
        if self.snap is not None:
            try:
                target, got = self._rollback(newest, landing)
                return target, got, "snapshot"
            except NoSnapshot as e:
                why = f"{why.split(': checkpointless')[0]}; {e}"
        if self.ckpt is not None:
            return self.load_checkpoint(why), None, "checkpoint"
        if self.snap is not None:
            why += ": checkpointless recovery is impossible; restart from a disk checkpoint"
        self.fatal(why)

    def _rollback(self, newest: int, landing: LandingPool | None = None) -> tuple[int, Received | None]:
        """Every rank goes back to the newest snapshot complete for all: its own copy, or
        one fetched from a holder on another node."""
        snap, steps = self.snap, self.steps
        assert snap is not None and steps is not None
        t0 = time.monotonic()
        try:
            step, frozen, plan, damaged = rollback(
                self.rec.groups["world"]._inner,
                lambda w: self.rec.wait(w, untimed=True),
                snap.store,
                self.rank,
                self.world_size,
                newest,
                2 * (1 + self.copies) + 2,
                attempts=1 + self.copies,
            )
        finally:
            for src, s in snap.store.corrupt_found:
                self.emit(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=self.rank, found="verify")
            snap.store.corrupt_found.clear()
        if self.rank == 0:
            for holder, src, s in damaged:
                self.emit(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=holder, found="transfer")
            self.emit(EventName.ROLLED_BACK, step=step, newest=newest, steps_redone=newest - step, fetches=len(plan))
        if frozen is not None:
            state, aux, written, landed = frozen.thaw_into(self._live(), landing)
            holder = next(f.holder for f in plan if f.src == self.rank)
            took = time.monotonic() - t0
            return step, Received(state, aux, frozen.nbytes, [holder], took, in_place=written, landed=landed)
        if steps.holding and steps.step == step:
            return step, None  # the live state is that step: only the aux rewinds
        own = snap.store.get(self.rank, step)
        assert own is not None
        state, aux, written, landed = own.thaw_into(self._live(), landing)
        return step, Received(state, aux, 0, [self.rank], time.monotonic() - t0, in_place=written, landed=landed)

    def saved_step(self) -> int | None:
        """The newest complete checkpoint as every rank sees it (one all-reduce: a rank
        with a stale listing must not leave the others in DCP's collectives alone)."""
        if self.ckpt is None:
            return None
        mine = self.ckpt.newest_complete()
        seen = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        seen[self.rank] = (mine if mine is not None else -1) + 1
        self.rec.wait(self.rec.groups["world"]._inner.allreduce([seen]))
        views = set(self.rec.read(seen))
        if len(views) > 1:
            self.fatal(
                f"ranks see different newest checkpoints in {self.ckpt.directory} (steps "
                f"{sorted(v - 1 for v in views)}): --checkpoint-dir must be one shared file system"
            )
        step = views.pop() - 1
        return step if step >= 0 else None

    def load_checkpoint(self, why: str) -> int:
        """Every rank loads the newest complete checkpoint in-process (no restart), or
        the job stops with one line."""
        ck, state, steps = self.ckpt, self.state, self.steps
        assert ck is not None and state is not None and steps is not None
        step = self.saved_step()
        if step is None:
            self.fatal(f"{why}; and no complete checkpoint in {ck.directory} yet")
        t0 = time.monotonic()
        try:
            aux = ck.load(step, state)
        except (OSError, ValueError, RuntimeError) as e:
            group = self._ckpt_group
            if group is not None and group._intr.error is not None:  # a peer, not the files: recover again
                raise Reformed(f"loading checkpoint step {step}: {group._intr.error}") from None
            # the files: every rank fails alike (DCP gathers every rank's error)
            self.fatal(f"{why}; and loading checkpoint step {step} from {ck.directory} failed: {e}"[:2000])
        state.rewind_aux(aux if aux else steps.committed_aux)
        steps.replayed(step, state.capture_aux())
        state.reset_hooks(aux.get("ddp_buckets") if aux else None)
        took = time.monotonic() - t0
        # one write (not print's two): the ranks share one stderr pipe
        sys.stderr.write(f"resild: rank {self.rank} loaded checkpoint step {step} in {took:.3f}s\n")
        if self.rank == 0:
            self.emit(EventName.CHECKPOINT_LOADED, step=step, seconds=round(took, 4), why=why[:300])
        return step

    def after_join(self, target: int) -> None:
        if self.snap is not None:
            self.snap.after_recovery(target)
            if target == 0:  # the start (or a fault before the first commit): protect the initial state
                self.snap.after_commit(0, vote=1)

    # ---- the end -------------------------------------------------------------------------
    def writing(self) -> bool:
        """A disk checkpoint of this rank is still being written."""
        return self.ckpt is not None and self.ckpt.busy()

    def before_done(self, timeout_s: float) -> str | None:
        """Report what snapshots cost this rank (bench/snapshots.py reads it), and let the
        last checkpoint finish. -> a warning, if it did not."""
        if self.snap is not None:
            s = self.snap
            self.emit(
                EventName.SNAPSHOTS,
                copies=self.copies,
                every=s.cadence.every,
                taken=s.taken,
                skipped=s.skipped,
                capture_s=round(s.capture_s, 4),
                exchange_s=round(s.exchanger.last_s, 4),
                held_bytes=s.store.nbytes,
            )
        if self.ckpt is None:
            return None
        # A save a recovery abandoned can never complete: not waited for.
        finished = self.ckpt.wait(0.0 if self.ckpt.abandoned() else timeout_s) or self.ckpt.abandoned()
        self._report_saves(self.ckpt)
        if finished:
            return None
        why = f"did not finish within {timeout_s:.0f}s of the end of the job"
        if self.rank == 0:
            self.emit(EventName.CHECKPOINT_FAILED, step=self.ckpt.inflight, abandoned=False, error=why)
        return f"the last disk checkpoint {why}"
