"""Wrong gradients: every `--verify-every K` steps each rank computes its step twice and
compares (the deterministic replay torchtitan uses, on the rank's own gradients).

A GPU that computes wrong numbers without drifting its state is out of the replicas'
fingerprints' reach: the all-reduce averages its wrong gradients into every replica. So,
before resild averages them:

    pass 1  job.commit(): a digest of this rank's gradients; the step's RNG and data
            position rewound (StepState.committed_aux) and its gradients dropped; commit()
            returns False and job.steps() yields the same step again
    pass 2  job.commit(): the digest again; "mine differed" is this rank's number in the
            commit vote (CommitProtocol.veto)
    vote    nobody differed: the step commits as usual. Some differed (`judge`): nobody
            commits; those ranks leave as faulty devices (their nodes are replaced) and the
            step is computed again after the recovery. Most or all differed: the loop does
            not reproduce its step (a program error, not a fault): the job stops in one line.

Only gradients resild averages itself (a plain model) can be compared before they are
averaged: DDP and FSDP2 average in their backward, and are refused at set-up.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from launcher.worker.redundancy.fingerprint import fingerprint
from resild.events.schema import EventName


class Verdict(enum.Enum):
    COMMIT = "commit"  # every rank computed the step alike twice
    FAULTY = "faulty"  # a few ranks did not: their devices are faulty
    NOT_REPRODUCIBLE = "not reproducible"  # most did not: the loop itself does not reproduce


def judge(differed: int, world: int) -> Verdict:
    """Pure: `differed` ranks of `world` got two different results for the same step."""
    if differed <= 0:
        return Verdict.COMMIT
    if differed == world or differed * 2 > world:
        return Verdict.NOT_REPRODUCIBLE
    return Verdict.FAULTY


def grad_digest(model: torch.nn.Module) -> int:
    """Of every trainable parameter's gradient, in order (a missing one counts as such)."""
    grads = [p.grad if p.grad is not None else torch.empty(0) for p in model.parameters() if p.requires_grad]
    return fingerprint(grads)


class StepVerifier:
    """One rank's side: which steps are verified, the first pass's digest, and the vote."""

    def __init__(
        self, every: int, rank: int, world_size: int, emit: Callable[..., Any], fatal: Callable[[str], NoReturn]
    ) -> None:
        self.every, self.rank, self.world_size, self.emit, self.fatal = every, rank, world_size, emit, fatal
        self._first: tuple[int, int] | None = None  # (step, digest) of the first pass
        self.differed = 0  # 1: this rank's two passes of the current step differed
        self.verified = 0  # steps this rank computed twice alike

    def due(self, step: int) -> bool:
        """Is `step` (the step being computed: steps committed so far) verified?"""
        return self.every > 0 and (step + 1) % self.every == 0

    def again(self, step: int, digest: int) -> bool:
        """At commit: -> True for the first pass (compute the step again), False for the
        second (its verdict is this rank's vote flag)."""
        if self._first is None or self._first[0] != step:
            self._first, self.differed = (step, digest), 0
            return True
        self.differed = int(digest != self._first[1])
        self.verified += 1 - self.differed
        self._first = None
        return False

    def reset(self) -> None:
        """A recovery: a first pass from before it is not compared with anything after it."""
        self._first, self.differed = None, 0

    # ---- the commit vote's veto (CommitProtocol) -------------------------------------
    def vote_flag(self) -> int:
        return self.differed

    def rejected(self, step: int, differed: int) -> None:
        """The vote says `differed` ranks got two results for `step` (> 0): nobody commits
        it. Raises on a rank that did; stops the job when the loop does not reproduce."""
        mine, self.differed = self.differed, 0
        verdict = judge(differed, self.world_size)
        if verdict is Verdict.NOT_REPRODUCIBLE:
            self.fatal(
                f"--verify-every: {differed} of {self.world_size} ranks computed step {step} twice and got different "
                "gradients: the training step does not reproduce (data not derived from the step or restored through "
                "extra=, an RNG resild does not restore, nondeterministic kernels); make it reproduce or run "
                "without --verify-every"
            )
        if mine:
            self.emit(EventName.GRADIENTS_DIFFERED, step=step, ranks=differed)
            raise RuntimeError(
                f"resild: rank {self.rank} computed step {step} twice from the same data and got different gradients "
                "(--verify-every): a faulty device; this node leaves and a spare takes its ranks"
            )
