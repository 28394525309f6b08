"""The commit protocol of one rank: sync the gradients, prepare, vote, then apply
or discard; at a recovery, settle a step left in doubt and resume.

The vote is one all-reduce of every rank's GradScaler verdict. If it completes,
every rank of the epoch synced this step, so the step commits (optimizer,
GradScaler, scheduler). If it is cut off (a latched error, a newer epoch), the
rank is PREPARED and in doubt: the vote may have completed elsewhere, and only
the recovery's agreement says whether to roll forward or discard. The phases
are in `step_state`.

Two ways to wait for the vote (`vote_mode`):

- BLOCKING: the optimizer steps only once the vote completed. Required where ranks
  hold different state (HSDP, FSDP2, TP): a rank that stepped early could be the only
  holder of its shard's new step while another shard's only holders never synced it,
  and no step would then be whole in memory.
- OVERLAPPED: every rank holds the whole state (DP, DDP) and the backend completes
  collectives on the host (gloo): the optimizer steps while
  the vote is in flight, so the vote's latency and the ranks' skew hide behind the
  step instead of adding to it. Safe because a rank steps only when every collective
  of its epoch so far completed, so its new state is the step's one true result and
  any replica behind it can receive it: in a recovery such a rank counts as a holder
  of the new step whether or not its vote completed. The GradScaler verdict is then
  each rank's own (identical after the sync); the completed vote checks it, and a rank
  its replicas outvote leaves like a rank whose fingerprint differs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from launcher.worker.recovery import Agreement
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.snapshot_manager import SnapshotManager
from launcher.worker.stable_group import Interrupts, StableGroup
from launcher.worker.state_transport import Received
from launcher.worker.step_state import StepState
from launcher.worker.train_state import TrainState


class VoteMode(enum.Enum):
    BLOCKING = "blocking"
    OVERLAPPED = "overlapped"


@dataclass(frozen=True)
class VoteChoice:
    mode: VoteMode
    reason: str


def vote_mode(setting: str, backend: str, replicas: ReplicaMap, world_size: int, snapshots: bool) -> VoteChoice:
    """Pure: how this job waits for its commit vote. `setting` is --commit-vote
    ("auto" or "blocking"); every rank computes the same from the same inputs."""
    if setting == "blocking":
        return VoteChoice(VoteMode.BLOCKING, "--commit-vote blocking")
    if backend == "nccl":
        # The CPU issues the optimizer's kernels before it knows the sync's kernels
        # completed; after an abort they would run on garbage gradients.
        return VoteChoice(VoteMode.BLOCKING, "NCCL: only the vote's read tells the sync completed")
    if replicas.groups != (tuple(range(world_size)),):
        return VoteChoice(VoteMode.BLOCKING, "ranks hold different state (sharded): the optimizer waits for the vote")
    if snapshots:
        return VoteChoice(VoteMode.BLOCKING, "peer-memory snapshots read the vote's exchange flag before the step")
    return VoteChoice(VoteMode.OVERLAPPED, "every rank holds the whole state: the optimizer steps during the vote")


class ReplicasDisagree(RuntimeError):
    """OVERLAPPED: ranks whose gradients are identical after the sync saw different
    inf/NaN verdicts, so some stepped and some skipped: a faulty device."""

    def __init__(self, message: str, no_majority: bool) -> None:
        super().__init__(message)
        self.no_majority = no_majority


def inf_majority(found: int, found_sum: int, n: int) -> tuple[int, bool]:
    """Pure: (the verdict of the majority of `n` ranks when `found_sum` saw inf/NaN,
    whether this rank's `found` is outvoted). A tie has no majority: ValueError."""
    if found_sum in (0, n):
        return found, False
    if 2 * found_sum == n:
        raise ValueError(f"{found_sum} of {n} ranks saw inf/NaN: no majority")
    verdict = int(2 * found_sum > n)
    return verdict, found != verdict


class CommitProtocol:
    """One rank's commit protocol over the job's world group."""

    def __init__(
        self,
        steps: StepState,
        train: TrainState,
        group: StableGroup,
        intr: Interrupts,
        abandoned: Callable[[], bool],
    ) -> None:
        self.steps, self.train, self.group, self.intr = steps, train, group, intr
        self.abandoned = abandoned  # the epoch failed or a newer one was announced: the step is lost
        self.snap: SnapshotManager | None = None  # peer-memory snapshots, when the job keeps them
        self.mode = VoteMode.BLOCKING  # set at attach (vote_mode)

    # ---- one step ------------------------------------------------------------------
    def sync(self) -> None:
        """Make this step's gradients identical across replicas, once per step. DDP and
        FSDP2 do it in their backward hooks; a plain model's are averaged here."""
        if self.steps.synced:
            return
        self.steps.mark_synced()
        if self.abandoned() or hooks_sync(self.train.model):
            return
        average_gradients(self.train.model, self.group, self.intr)

    def vote(self) -> bool:
        """Sync, prepare, vote; on a completed vote apply the step. False: the step was
        abandoned or is in doubt, and the caller must recover."""
        self.sync()
        found = self.train.local_found_inf()
        if self.abandoned():
            return False
        self.steps.prepare(self.train.capture_aux(), found)
        # [ranks that saw inf/NaN, ranks whose snapshot exchange is still running]
        busy = self.snap.vote_flag() if self.snap is not None else 0
        vote = torch.tensor([found, busy], dtype=torch.int64, device=self.train.device)
        work = self.group.allreduce([vote])
        if self.mode is VoteMode.OVERLAPPED and self.intr.error is None:
            return self._overlapped(work, vote, found)
        work.wait()
        found_sum, busy_sum = (int(x) for x in vote.tolist())
        # Checked after reading: on NCCL the read is what waits, and an aborted vote
        # leaves garbage there; the error is latched before the abort releases it.
        if self.intr.error is not None:
            return False
        # The vote completed, so every rank synced this step: commit.
        verdict = int(found_sum > 0)
        if self.snap is not None:
            self.snap.before_write()
        self.train.apply_step(verdict)
        self.steps.commit(verdict)
        if self.snap is not None:
            self.snap.after_commit(self.steps.step, busy_sum)
        return True

    def _overlapped(self, work: Any, vote: torch.Tensor, found: int) -> bool:
        """Step during the vote; the rank is a holder of the new step from here on."""
        step = self.steps.step
        self.train.apply_step(found)
        self.steps.commit(found)
        work.wait()
        found_sum = int(vote[0].item())
        if self.intr.error is not None:  # after the read, as in vote()
            return False  # in a recovery this rank's new step counts (see the module's docstring)
        n = self.group.size()
        try:
            _, outvoted = inf_majority(found, found_sum, n)
        except ValueError:
            raise ReplicasDisagree(
                f"step {step}: {found_sum} of {n} replicas saw inf/NaN in gradients that are identical after "
                "the sync, and no majority says which is right: a faulty device; restart from a checkpoint",
                no_majority=True,
            ) from None
        if outvoted:
            raise ReplicasDisagree(
                f"resild: rank {self.group.global_rank}'s inf/NaN check at step {step} disagreed with most of its "
                f"replicas ({found_sum} of {n} saw inf/NaN in gradients identical after the sync): a faulty device; "
                "this node leaves and a spare takes its ranks",
                no_majority=False,
            )
        return True

    def commit_alone(self) -> None:
        """A single process (no resil-run): no vote, nothing to replay."""
        found = self.train.local_found_inf()
        self.train.apply_step(found)
        self.steps.commit(found)

    # ---- recovery ----------------------------------------------------------------------
    def settle(self, ag: Agreement, rank: int) -> None:
        """After the agreement: roll forward if every rank voted for this step and some
        committed it (our gradients are the committed ones), else abandon it."""
        if rank in ag.rollers:
            self.train.apply_step(ag.found_inf)
            self.steps.commit(ag.found_inf)
        else:
            self.steps.abort()

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a replica sends: the replicated state at the committed step, and its aux."""
        return self.train.snapshot(self.steps.step), self.steps.committed_aux

    def resume(self, got: Received | None) -> None:
        """Continue from replayed state, or rewind this rank's aux to its last commit."""
        if got is not None:
            step = self.train.restore(got.state, got.aux)
            self.steps.replayed(step, self.train.capture_aux())
            self.train.reset_hooks(got.aux.get("ddp_buckets"))
        else:
            self.train.rewind_aux(self.steps.committed_aux)
            self.train.reset_hooks(self.steps.committed_aux.get("ddp_buckets"))


def average_gradients(model: torch.nn.Module, group: StableGroup, intr: Interrupts) -> None:
    """One flat all-reduce of every trainable parameter's gradient (missing ones as zeros)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    group.allreduce([flat]).wait()
    if intr.error is not None:
        return
    flat.div_(group.size())
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def hooks_sync(model: torch.nn.Module) -> bool:
    """Does the model's backward already synchronise gradients (DDP, FSDP2)?"""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())
