"""The after-commit hooks that redundancy registers with the commit protocol
(launcher.worker.commit.CommitHook): replicas' fingerprints compared, and resild's disk
checkpoints started. Peer-memory snapshots are one too (snapshot_cadence.SnapshotManager).
Registered snapshots, fingerprints, checkpoints: a diverged step is never saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from launcher.worker.redundancy.agreed_state import AgreedCopy
from launcher.worker.redundancy.checkpoint_cadence import Action, CheckpointCadence, flag
from launcher.worker.redundancy.disk_checkpoint import DiskCheckpointer
from launcher.worker.redundancy.fingerprint import fingerprint, judge
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.stable_group import StableGroup
from launcher.worker.step_state import StepState
from launcher.worker.train_state import TrainState
from resild.events.schema import EventName


class FingerprintHook:
    """Every `every` steps, every rank's state fingerprint in one all-reduce. Agreeing
    replicas keep a copy of their state (`agreed`); a rank its replicas outvote leaves (its
    node is replaced), and at that recovery every rank returns to the agreed copy
    (agreed_state): the outvoted rank's gradients since then are in every replica."""

    def __init__(
        self,
        every: int,
        state: TrainState,
        steps: StepState,
        agreed: AgreedCopy | None,
        replicas: Callable[[], ReplicaMap],
        group: StableGroup,
        rank: int,
        world_size: int,
        emit: Callable[..., Any],
        fatal: Callable[[str], NoReturn],
    ) -> None:
        self.every, self.state, self.steps, self.agreed = every, state, steps, agreed
        self.replicas, self.group = replicas, group
        self.rank, self.world_size, self.emit, self.fatal = rank, world_size, emit, fatal

    def vote_flag(self) -> int:
        return 0

    def before_write(self) -> None:
        if self.agreed is not None:
            self.agreed.before_write()

    def after_commit(self, step: int, vote_sum: int) -> bool:
        """-> the replicas agree (or the step was not compared)."""
        if step % self.every:
            return True
        mine = fingerprint(self.state.state_view(step))
        vals = torch.zeros(self.world_size, dtype=torch.int64, device=self.state.device)
        vals[self.rank] = mine
        self.group.allreduce([vals]).wait()
        values = vals.cpu().tolist()  # on NCCL the read is what waits: the error is checked after it
        if self.group.intr.error is not None:
            return True  # the epoch is failing: the next vote finds out
        verdict = judge(values, self.replicas().groups)
        if verdict.clean:
            if self.agreed is not None:
                self.agreed.keep(step, mine, self.state.state_view(step), self.steps.committed_aux)
                self.steps.agreed = step
            return True
        self.steps.diverged_at = step  # the recovery that follows returns to the agreed copy
        # One rank says so: the lowest odd rank, which always gets here (it leaves next, and its
        # link flushes before its failure is reported); rank 0 may not, when the odd rank's
        # failure has already latched the epoch's error by the time it checks (a loaded host).
        speaker = min(verdict.odd) if verdict.odd else 0
        if self.rank == speaker:
            self.emit(
                EventName.REPLICA_DIVERGED,
                step=step,
                odd=list(verdict.odd),
                undecided=[list(g) for g in verdict.undecided],
                agreed=self.steps.agreed if self.agreed is not None else None,
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


class CheckpointHook:
    """Starts a due disk checkpoint when the vote says no rank is writing (every rank has
    the same sum, so every rank decides alike), and reports how saves ended. Never waits:
    a slow or hung file system defers checkpoints, never training."""

    def __init__(
        self,
        ckpt: DiskCheckpointer,
        cadence: CheckpointCadence,
        state: TrainState,
        steps: StepState,
        rank: int,
        emit: Callable[..., Any],
    ) -> None:
        self.ckpt, self.cadence, self.state, self.steps = ckpt, cadence, state, steps
        self.rank, self.emit = rank, emit

    def vote_flag(self) -> int:
        return flag(self.ckpt.busy(), self.ckpt.broken())

    def before_write(self) -> None:
        pass

    def after_commit(self, step: int, vote_sum: int) -> bool:
        """`vote_sum`: every rank's writer flag (checkpoint_cadence.flag) summed."""
        self.report_saves()
        d = self.cadence.on_commit(step, vote_sum)
        if d.action is Action.SAVE:
            self.ckpt.save(step, self.state, self.steps.committed_aux)
        elif d.first and self.rank == 0:
            self.emit(EventName.CHECKPOINT_DEFERRED, step=step, due=self.cadence.pending, reason=d.reason)
        return True

    def report_saves(self) -> None:
        """Rank 0 says how each save ended: every rank's ends alike (DCP gathers a rank's
        failure to all, and the COMPLETE confirmation is an all-reduce)."""
        for o in self.ckpt.take_outcomes():
            if self.rank != 0:
                continue
            if o.result == "saved":
                self.emit(EventName.CHECKPOINT_SAVED, step=o.step, seconds=round(o.seconds, 4), bytes=o.nbytes)
            else:
                self.emit(
                    EventName.CHECKPOINT_FAILED,
                    step=o.step,
                    seconds=round(o.seconds, 4),
                    abandoned=o.result == "abandoned",
                    error=o.error,
                )
