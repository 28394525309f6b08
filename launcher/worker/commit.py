"""The commit protocol of one rank: sync the gradients, prepare, vote, then apply
or discard; at a recovery, settle a step left in doubt and resume.

The vote is one all-reduce of every rank's GradScaler verdict. If it completes,
every rank of the epoch synced this step, so the step commits (optimizer,
GradScaler, scheduler). If it is cut off (a latched error, a newer epoch), the
rank is PREPARED and in doubt: the vote may have completed elsewhere, and only
the recovery's agreement says whether to roll forward or discard. The phases
are in `step_state`.

What else happens at a commit (snapshots, fingerprints, disk checkpoints) registers
as a `CommitHook`: this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from launcher.worker.collective_check import CollectiveCheck
from launcher.worker.recovery import Agreement
from launcher.worker.stable_group import Interrupts, StableGroup
from launcher.worker.step_state import StepState
from launcher.worker.train_state import TrainState
from launcher.worker.transport.state_transport import Received


class CommitHook(Protocol):
    """Runs at every committed step, in registration order, which is the same on every
    rank (hooks are registered from the job's settings, identical everywhere)."""

    def vote_flag(self) -> int:
        """This rank's number in the step's commit vote (summed over every rank); 0 if the
        hook needs none."""
        ...

    def before_write(self) -> None:
        """The live state is about to change (a step applied, a state restored)."""
        ...

    def after_commit(self, step: int, vote_sum: int) -> bool:
        """The step committed; `vote_sum`: every rank's vote_flag() summed. -> False: the
        step's state is not fit to keep (a divergence): the hooks after this one skip it."""
        ...


class Tally(Protocol):
    """Numbers in the commit vote, summed over every rank, that every rank reads alike
    (--snapshot-every auto's cadence). The same count of terms on every rank."""

    def vote_terms(self) -> list[int]: ...

    def voted(self, sums: list[int]) -> None:
        """The step's summed terms, before any hook's `after_commit` (also of a vetoed step)."""
        ...


class Veto(Protocol):
    """A number in the commit vote that, summed over every rank, may reject the step."""

    def vote_flag(self) -> int: ...

    def rejected(self, step: int, total: int) -> None:
        """Every rank's flags summed to `total` > 0: nobody commits `step` (may raise)."""
        ...


class CommitProtocol:
    """One rank's commit protocol over the job's world group."""

    def __init__(
        self,
        steps: StepState,
        train: TrainState,
        group: StableGroup,
        intr: Interrupts,
        abandoned: Callable[[], bool],
        checks: CollectiveCheck | None = None,
    ) -> None:
        self.steps, self.train, self.group, self.intr = steps, train, group, intr
        self.checks = checks  # the step's collectives, compared in the vote
        self.abandoned = abandoned  # the epoch failed or a newer one was announced: the step is lost
        self.hooks: list[CommitHook] = []  # launcher.worker.redundancy.coordinator registers them
        self.veto: Veto | None = None  # a vote that may reject the step (--verify-every)
        self.tallies: list[Tally] = []

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
        # [ranks that saw inf/NaN, then each hook's flag: for example ranks whose snapshot
        #  exchange is still running, ranks whose disk checkpoint is still being written,
        #  then the digest of the step's collectives (collective_check.vote_terms), then the
        #  tallies' terms (--snapshot-every auto: the cadence each rank asks for)]
        flags = [found] + [h.vote_flag() for h in self.hooks] + ([self.veto.vote_flag()] if self.veto else [])
        terms = self.checks.vote_terms() if self.checks is not None else []
        tallied = [t.vote_terms() for t in self.tallies]
        extra = [x for ts in tallied for x in ts]
        vote = torch.tensor(flags + terms + extra, dtype=torch.int64, device=self.train.device)
        self.group.allreduce([vote]).wait()
        voted = [int(x) for x in vote.tolist()]  # one read: on NCCL each read is a device sync
        found_sum, *sums = voted[: len(flags)]
        vetoed = sums.pop() if self.veto is not None else 0
        term_sums = voted[len(flags) : len(flags) + len(terms)]
        off = len(flags) + len(terms)
        # Checked after the read: on NCCL wait() only orders streams and the read is what
        # blocks; an abort releases it with garbage, and the error is latched before the abort.
        if self.intr.error is not None:
            return False
        if self.checks is not None:
            self.checks.voted(term_sums)
        for tally, ts in zip(self.tallies, tallied, strict=True):
            tally.voted(voted[off : off + len(ts)])
            off += len(ts)
        if self.veto is not None and vetoed:  # nobody commits this step: it is computed again after a recovery
            self.steps.abort()
            self.train.rewind_aux(self.steps.committed_aux)
            self.veto.rejected(self.steps.step, vetoed)  # raises on the ranks it names
            return False
        # The vote completed, so every rank synced this step: commit.
        verdict = int(found_sum > 0)
        self.before_write()
        self.train.apply_step(verdict)
        self.steps.commit(verdict)
        for hook, total in zip(self.hooks, sums, strict=True):
            if not hook.after_commit(self.steps.step, total):
                break
        return True

    def before_write(self) -> None:
        """The live state is about to change: every hook finishes what still reads it."""
        for hook in self.hooks:
            hook.before_write()

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

    def receive_into(self) -> dict[str, Any]:
        """The live state a replay may write in place (this rank's own parameters and
        optimizer state, uncopied). From here on this rank holds no step until `resume`."""
        self.steps.discard()
        return self.train.state_view(self.steps.step)  # the step in it is not read: only tensors

    def replica_token(self) -> tuple[int, bool, int, int]:
        """What replica_state's content hangs on besides its tensors' bytes (the step, the
        committed aux, the optimizer steps and restores applied): alike while it is alike."""
        s = self.steps
        return s.step, s.holding, id(s.committed_aux), self.train.generation

    def replica_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a replica sends (and a snapshot captures): the replicated state at the
        committed step, and its aux."""
        return self.train.state_view(self.steps.step), self.steps.committed_aux

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
