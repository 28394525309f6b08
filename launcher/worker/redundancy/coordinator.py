"""Redundancy beyond replicas, one part behind the `Job` facade: peer-memory snapshots
and rollback, resild's own disk checkpoints, and replicas' fingerprints.

It builds them from the job's settings and registers what runs at every commit with
the commit protocol (after-commit hooks: snapshots, fingerprints, checkpoints, in this
order). The facade calls it at fixed points of the recovery and the end:

  attach        -> setup()              groups of their own, formed like the mesh's
  recovery      -> abandon() at the start, formed() once the epoch's groups exist,
                   after_join() at the end (restoring is launcher.worker.sources')
  end of job    -> before_done()
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

import resild.wire.env as resild_env
from launcher.worker.commit import CommitProtocol, hooks_sync
from launcher.worker.recovery import RecoverySequence
from launcher.worker.redundancy import agreed_state, checkpoint_faults
from launcher.worker.redundancy.agreed_state import AgreedCopy
from launcher.worker.redundancy.checkpoint_cadence import CheckpointCadence
from launcher.worker.redundancy.device_stager import DeviceStager
from launcher.worker.redundancy.disk_checkpoint import DiskCheckpointer
from launcher.worker.redundancy.fingerprint import fingerprint
from launcher.worker.redundancy.hooks import CheckpointHook, FingerprintHook
from launcher.worker.redundancy.snapshot_cadence import SnapshotManager
from launcher.worker.redundancy.snapshot_exchange import Exchanger
from launcher.worker.redundancy.snapshot_store import PlacementError, SnapshotStore, check_placement
from launcher.worker.redundancy.verify import StepVerifier, grad_digest
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.stable_group import StableGroup
from launcher.worker.step_state import NONE, StepState
from launcher.worker.train_state import TrainState
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
        rec: RecoverySequence,
        emit: Callable[..., None],
        fatal: Callable[[str], NoReturn],
    ) -> None:
        self.settings, self.rank, self.world_size, self.per_node = settings, rank, world_size, per_node
        self.device, self.rec, self.emit, self.fatal = device, rec, emit, fatal
        self.snap: SnapshotManager | None = None
        self.ckpt: DiskCheckpointer | None = None
        self.copies = 0
        self.ckpt_group: StableGroup | None = None
        self.ckpt_hook: CheckpointHook | None = None
        self.cadence: CheckpointCadence | None = None
        self._protocol: CommitProtocol | None = None
        self.state: TrainState | None = None
        self.steps: StepState | None = None
        self.agreed: AgreedCopy | None = None  # the last state the replicas' fingerprints agreed on
        self.verifier: StepVerifier | None = None  # --verify-every: steps computed twice
        self._rolled_back_to: int | None = None  # the step this recovery returned every rank to
        self._unverified_said = False

    # ---- set-up ----------------------------------------------------------------------
    def setup(
        self,
        state: TrainState,
        steps: StepState,
        protocol: CommitProtocol,
        replicas: Callable[[], ReplicaMap],
        world: StableGroup,
        new_group: Callable[[str, float | None], StableGroup],
    ) -> None:
        """`new_group(label, timeout_s)`: a gloo StableGroup of every rank, registered and
        formed. Registers the after-commit hooks in the order they run: snapshots (they
        keep what committed), fingerprints, then checkpoints (a diverged step is not saved)."""
        self.state, self.steps, self._protocol = state, steps, protocol
        self._setup_snapshots(protocol, replicas(), new_group)
        if self.snap is not None:
            protocol.hooks.append(self.snap)
        if self.settings.fingerprint_every:
            rollback = os.environ.get(resild_env.DIVERGENCE_ROLLBACK.name, resild_env.DIVERGENCE_ROLLBACK.default)
            self.agreed = AgreedCopy(self.rank, self.device) if rollback != "0" else None
            protocol.hooks.append(
                FingerprintHook(
                    self.settings.fingerprint_every,
                    state,
                    steps,
                    self.agreed,
                    replicas,
                    world,
                    self.rank,
                    self.world_size,
                    self.emit,
                    self.fatal,
                )
            )
        self._setup_checkpoints(new_group)
        if self.ckpt_hook is not None:
            protocol.hooks.append(self.ckpt_hook)
        if self.settings.verify_every:
            if hooks_sync(state.model):
                raise RedundancyError(
                    f"--verify-every {self.settings.verify_every} compares each rank's own gradients before they are "
                    "averaged, and this model averages them in its backward (DDP or FSDP2): run it without "
                    "--verify-every"
                )
            self.verifier = protocol.veto = StepVerifier(
                self.settings.verify_every, self.rank, self.world_size, self.emit, self.fatal
            )

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
        exchanger = Exchanger(store, g, self.rank, self.world_size, self.per_node, copies, self.rec.mac)
        stager = DeviceStager(self.device) if self.device.type == "cuda" else None
        self.snap = SnapshotManager(
            store,
            exchanger,
            self.settings.snapshot_every,
            protocol.replica_state,
            stager,
            budget=self.settings.snapshot_budget,
            on_cadence=self._cadence_changed if self.rank == 0 else None,
        )
        if self.snap.meter is not None:
            protocol.tallies.append(self.snap)
        self.copies = copies

    def _cadence_changed(self, every: int, reason: str) -> None:
        self.emit(EventName.SNAPSHOT_CADENCE, every=every, reason=reason, budget=self.settings.snapshot_budget)

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
        g = self.ckpt_group = new_group("resild-checkpoint", CHECKPOINT_GROUP_TIMEOUT_S)
        ck = self.ckpt = DiskCheckpointer(
            Path(s.checkpoint_dir),
            s.checkpoint_every,
            self.rank,
            self.world_size,
            g,
            keep=2,
            intr=g.intr,
            faults=checkpoint_faults.Faults(faults, self.rank, os.environ.get(resild_env.NODE.name, ""))
            if faults
            else None,
        )
        self.cadence = CheckpointCadence(s.checkpoint_every)
        # The job's epoch failing releases the checkpoint group too, at once: a load on the
        # training thread must not wait out the group's hour-long timeout for a dead peer.
        self.rec.intr.on_fail.append(self._abandon_checkpoint)
        assert self.state is not None and self.steps is not None
        self.ckpt_hook = CheckpointHook(ck, self.cadence, self.state, self.steps, self.rank, self.emit)

    # ---- fault injection ------------------------------------------------------------------
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

    def bad_gradients(self, step: int) -> None:
        """Fault injection: what a GPU computing wrong numbers for one step leaves behind, in
        this rank's gradients before they are averaged. Said unvouched for where no
        verification will compare the step."""
        assert self.state is not None
        g = next(p.grad for p in self.state.model.parameters() if p.grad is not None)
        with torch.no_grad():
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] += 1.0
        if self.verifier is None or not self.verifier.due(step):
            every = self.settings.verify_every
            self.emit(
                EventName.STATE_UNVOUCHED,
                step=step,
                reason=f"rank {self.rank}'s gradients of step {step} were wrong (badgrad) and no verification "
                f"compared that step (--verify-every {every}): every replica averaged them in",
            )

    # ---- --verify-every ---------------------------------------------------------------------
    def verify_again(self, step: int) -> bool:
        """At commit: -> True when this step is to be computed a second time (its first pass
        is recorded; RNG and data position rewound, gradients dropped)."""
        v, steps, state = self.verifier, self.steps, self.state
        if v is None or not v.due(step):
            return False
        assert steps is not None and state is not None
        if steps.synced:  # the loop averaged its gradients itself (job.sync()): nothing local to compare
            if self.rank == 0 and not self._unverified_said:
                self._unverified_said = True
                self.emit(
                    EventName.STATE_UNVOUCHED,
                    step=step,
                    reason=f"step {step} was not verified (--verify-every): the loop called job.sync() before "
                    "job.commit(), so no rank's own gradients were left to compare",
                )
            return False
        if not v.again(step, grad_digest(state.model)):
            return False
        state.rewind_aux(steps.committed_aux)
        return True

    # ---- recovery -----------------------------------------------------------------------
    def abandon(self) -> None:
        """A recovery begins: snapshot exchanges and checkpoint writes in flight belong to
        the failed epoch (the checkpoint's collectives are released)."""
        if self.snap is not None:
            self.snap.abandon()
        self._abandon_checkpoint()

    def _abandon_checkpoint(self) -> None:
        """Never blocks (also an `Interrupts.on_fail` hook of the job's epoch)."""
        if self.ckpt is not None and self.ckpt_group is not None:
            self.ckpt.abandon()
            self.ckpt_group.intr.fail("a new epoch")

    def close(self) -> None:
        """This redundancy is replaced (the job changed width): stop listening to the epoch."""
        try:
            self.rec.intr.on_fail.remove(self._abandon_checkpoint)
        except ValueError:
            pass  # no checkpoints: never added

    def formed(self) -> None:
        """The new epoch's groups exist: a new generation, the abandoned save never completes."""
        if self.ckpt_group is not None:
            self.ckpt_group.intr.clear()
        if self.cadence is not None:
            self.cadence.after_recovery()

    def after_divergence(self, rows: list[list[int]]) -> int | None:
        """At a recovery's agreement (`rows`: every rank's row): if some rank saw replicas
        diverge, every rank holding the last agreed step returns to it (agreed_state.plan);
        -> that step, which the recovery then completes (a spare, or a rank whose copy failed
        its check, receives it from a replica). None: nothing to roll back."""
        steps, protocol = self.steps, self._protocol
        assert steps is not None and protocol is not None
        back = agreed_state.plan(rows)
        steps.diverged_at = 0
        self._rolled_back_to = None
        if back is None:
            return None
        if back.step is None:
            why = back.unvouched
            if self.agreed is None:  # the same setting on every rank
                why = (
                    f"replicas diverged at step {back.diverged_at} and no agreed state was kept "
                    f"({resild_env.DIVERGENCE_ROLLBACK.name}=0): the faulty rank's gradients since the last compare "
                    "are in every replica"
                )
            if self.rank == 0:
                self.emit(EventName.STATE_UNVOUCHED, step=back.diverged_at, reason=why)
            return None
        if self.snap is not None:
            self.snap.store.drop_after(back.step)  # snapshots since the agreed step hold the divergence
        copy = self.agreed
        checked: bool | None = None
        if copy is not None and copy.step == back.step and steps.holding:
            t0 = time.monotonic()
            state, aux, written = copy.restore_into(protocol.receive_into())
            protocol.resume(Received(state, aux, 0, [self.rank], time.monotonic() - t0, in_place=written))
            checked = copy.matches(self.state.state_view(back.step)) if self.state is not None else False
            if not checked:  # damaged in host memory: this rank receives the step from a replica
                copy.drop()
                steps.agreed = NONE
        if checked is not True and steps.holding:
            protocol.receive_into()  # holds no step now: the replay that follows fills it
        if self.rank == 0:
            self.emit(
                EventName.ROLLED_BACK,
                step=back.step,
                newest=back.diverged_at,
                steps_redone=back.redone,
                fetches=0,
                reason="divergence",
            )
        if checked is False:
            self.emit(EventName.SNAPSHOT_CORRUPT, src=self.rank, step=back.step, holder=self.rank, found="agreed copy")
        self._rolled_back_to = back.step
        return back.step

    def after_join(self, target: int) -> None:
        if self.verifier is not None:
            self.verifier.reset()
        steps, state, copy = self.steps, self.state, self.agreed
        if self._rolled_back_to == target and copy is not None and steps is not None and state is not None:
            # Every rank holds the agreed step now, the ones that received it too (a spare, a rank
            # whose copy failed): each keeps it, so a second divergence before the next compare
            # (an arbitration that names the other replica) still has it to return to.
            if steps.agreed != target:
                view = state.state_view(target)
                copy.keep(target, fingerprint(view), view, steps.committed_aux)
                steps.agreed = target
        self._rolled_back_to = None
        if self.snap is not None:
            self.snap.after_recovery(target)
            if target == 0:  # the start (or a fault before the first commit): protect the initial state
                self.snap.after_commit(0, vote_sum=1)

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
                auto=s.meter is not None,
                cost_s=round(s.want.cost_s, 5) if s.want is not None and s.want.cost_s is not None else None,
                step_s=round(s.want.step_s, 5) if s.want is not None and s.want.step_s is not None else None,
                taken=s.taken,
                since_join=list(s.since_join),
                skipped=s.skipped,
                capture_s=round(s.capture_s, 4),
                exchange_s=round(s.exchanger.last_s, 4),
                held_bytes=s.store.nbytes,
            )
        if self.verifier is not None:  # bench/corruption_checks.py reads it
            self.emit(EventName.STEPS_VERIFIED, verified=self.verifier.verified, every=self.verifier.every)
        if self.agreed is not None:  # bench/corruption_checks.py reads it
            a = self.agreed
            self.emit(EventName.AGREED_STATE, kept=a.kept, capture_s=round(a.capture_s, 4), held_bytes=a.nbytes)
        if self.ckpt is None:
            return None
        # A save a recovery abandoned can never complete: not waited for.
        finished = self.ckpt.wait(0.0 if self.ckpt.abandoned() else timeout_s) or self.ckpt.abandoned()
        if self.ckpt_hook is not None:
            self.ckpt_hook.report_saves()
        if finished:
            return None
        why = f"did not finish within {timeout_s:.0f}s of the end of the job"
        if self.rank == 0:
            self.emit(EventName.CHECKPOINT_FAILED, step=self.ckpt.inflight, abandoned=False, error=why)
        return f"the last disk checkpoint {why}"
