"""The after-commit hooks that redundancy registers with the commit protocol
(launcher.worker.commit.CommitHook): replicas' fingerprints compared, and resild's disk
checkpoints started. Peer-memory snapshots are one too (snapshot_cadence.SnapshotManager).
Registered snapshots, fingerprints, checkpoints: a diverged step is never saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from launcher.worker.redundancy.agreed_state import AgreedCopy
from launcher.worker.redundancy.arbitration import Pending, arbitrate, suspects_of
from launcher.worker.redundancy.checkpoint_cadence import Action, CheckpointCadence, flag
from launcher.worker.redundancy.disk_checkpoint import DiskCheckpointer
from launcher.worker.redundancy.fingerprint import Divergence, fingerprint, judge
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
        self.pending: Pending | None = None  # an arbitration under way (rank 0's copy is the one used)

    def vote_flag(self) -> int:
        return 0

    def before_write(self) -> None:
        if self.agreed is not None:
            self.agreed.before_write()

    def after_commit(self, step: int, vote_sum: int) -> bool:
        """-> the replicas agree (or the step was not compared)."""
        if step % self.every:
            return True
        view = self.state.state_view(step)  # new dicts around the live tensors: kept below too
        mine = fingerprint(view)
        # [every rank's fingerprint | the arbitration under way, as rank 0 holds it: every rank's
        #  fingerprint at the compare that found it, and that step + 1 (0: none)]. Rank 0 never
        # leaves as a suspect, and a spare holds nothing: every rank decides from rank 0's copy.
        w = self.world_size
        vals = torch.zeros(2 * w + 1, dtype=torch.int64, device=self.state.device)
        vals[self.rank] = mine
        if self.rank == 0 and self.pending is not None:
            vals[w : 2 * w] = torch.tensor(self.pending.first, dtype=torch.int64)
            vals[2 * w] = self.pending.step + 1
        work = self.group.allreduce([vals])
        work.wait()
        got = vals.cpu().tolist()  # on NCCL the read is what waits: the error is checked after it
        if self.group.intr.error is not None and not (self.state.device.type == "cpu" and _succeeded(work)):
            return True  # the epoch is failing: the next vote finds out
        # On the host a compare that completed is valid even if the epoch failed right after
        # (the odd rank leaving at once, on a loaded host): its verdict still sends every rank
        # back to the agreed step at the recovery.
        values = got[:w]
        pending = Pending(got[2 * w] - 1, tuple(got[w : 2 * w]), ()) if got[2 * w] else None
        if self.pending is not None and step >= self.pending.step:
            self.pending = None  # its compare has come (an earlier one, after a rollback further back, has not)
        verdict = judge(values, self.replicas().groups)
        rollback = True
        if pending is not None and pending.step == step:  # the spare recomputed the suspects' part
            pending = Pending(pending.step, pending.first, suspects_of(_undecided(pending.first, self.replicas())))
            out = arbitrate(pending, values)
            if out.stop:
                self.fatal(out.stop)
            settled = {r for pair in pending.pairs for r in pair}
            verdict = Divergence(
                tuple(sorted(set(verdict.odd) - settled | set(out.leave))),
                tuple(g for g in verdict.undecided if not set(g) & settled),
            )
            rollback = out.rollback or not set(verdict.odd) <= set(out.leave) or bool(verdict.undecided)
            if self.rank == (min(out.leave) if out.leave else 0):
                self.emit(EventName.REPLICA_ARBITRATED, step=step, faulty=list(out.faulty), leaving=list(out.leave))
        if verdict.clean:
            self._keep(step, mine, view)
            return True
        pairs = suspects_of(verdict.undecided)
        # The same on every rank (a setting and the verdict): whether agreed copies exist is the
        # recovery's to find (agreed_state.plan; without one the state is said unvouched).
        arbitrable = self.agreed is not None and len(pairs) == len(verdict.undecided)
        leaving = set(verdict.odd) | ({s for s, _ in pairs} if arbitrable else set())
        if rollback:
            self.steps.diverged_at = step  # the recovery that follows returns to the agreed copy
        else:  # the ones leaving did not reach the others: what they agree on is the job's state
            self._keep(step, mine, view)
        # One rank says so: the lowest leaving rank, which always gets here (it leaves next, and its
        # link flushes before its failure is reported); rank 0 may not, when a leaving rank's
        # failure has already latched the epoch's error by the time it checks (a loaded host).
        if self.rank == (min(leaving) if leaving else 0):
            self.emit(
                EventName.REPLICA_DIVERGED,
                step=step,
                odd=list(verdict.odd),
                undecided=[list(g) for g in verdict.undecided],
                agreed=self.steps.agreed if self.agreed is not None else None,
                arbitrate=sorted(s for s, _ in pairs) if arbitrable else [],
            )
        if verdict.undecided and not arbitrable:
            self.fatal(
                f"replicas {[list(g) for g in verdict.undecided]} hold different state at step {step} and no "
                "majority says which is right: a faulty device; restart from a checkpoint"
            )
        if verdict.undecided:
            self.pending = Pending(step, tuple(values), pairs)
        if self.rank in verdict.odd:
            raise RuntimeError(
                f"resild: rank {self.rank}'s state diverged from its replicas at step {step} (fingerprints "
                "differ): a faulty device; this node leaves and a spare takes its ranks"
            )
        if self.rank in leaving:
            raise RuntimeError(
                f"resild: rank {self.rank}'s state differs from its one replica's at step {step} and no majority "
                "says which is right: this node leaves, and a spare recomputes its part since the last agreed step "
                "to arbitrate (with no spare free, the job stops)"
            )
        return False  # the odd ranks leave; the rest wait for the recovery that follows

    def _keep(self, step: int, value: int, view: dict[str, Any]) -> None:
        if self.agreed is not None:
            self.agreed.keep(step, value, view, self.steps.committed_aux)
            self.steps.agreed = step


def _undecided(first: tuple[int, ...], replicas: ReplicaMap) -> tuple[tuple[int, ...], ...]:
    """The groups without a majority in `first` (the compare that found them)."""
    return judge(list(first), replicas.groups).undecided


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


def _succeeded(work: Any) -> bool:
    """The backend work behind a StableGroup's completed without error (not merely released)."""
    return bool(getattr(work, "succeeded", False))
