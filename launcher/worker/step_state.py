"""Where this rank is in the current step's commit protocol (torchft's Manager phases are the model).

    IDLE ──sync──> SYNCED ──prepare──> PREPARED ──vote completed──> COMMITTED ──> IDLE (step + 1)
      │              │                    └──vote cut off, nobody committed──> ABORTED ──> IDLE
      │              └──epoch failed before the vote──────────────────────────> ABORTED
      └──solo: no vote─────────────────────────────────────────────────────────> COMMITTED

A PREPARED rank is *in doubt*: it voted, but its vote may have completed on
another rank, which then committed. Only the recovery's agreement settles it:
roll forward (PREPARED -> COMMITTED) or discard (PREPARED -> ABORTED). After a
public call returns, the phase is IDLE or SYNCED (the step being computed);
COMMITTED and ABORTED are passed through on the way to the next step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    IDLE = "idle"  # computing the step; gradients not yet synced
    SYNCED = "synced"  # gradients synced (or the sync skipped: the epoch is failing)
    PREPARED = "prepared"  # voted: aux captured, vote issued; committed elsewhere or not, recovery decides
    COMMITTED = "committed"  # the optimizer stepped
    ABORTED = "aborted"  # the step was abandoned


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.IDLE, Phase.SYNCED, Phase.COMMITTED}),  # IDLE -> IDLE: a join before any work
    Phase.SYNCED: frozenset({Phase.PREPARED, Phase.ABORTED}),
    Phase.PREPARED: frozenset({Phase.COMMITTED, Phase.ABORTED}),
    Phase.COMMITTED: frozenset({Phase.IDLE}),
    Phase.ABORTED: frozenset({Phase.IDLE}),
}


NONE = -1  # the step of a rank that holds no usable state (a replay into it is under way)


class ProtocolError(RuntimeError):
    """A transition the table does not allow: a bug in resild, not in the training loop."""


@dataclass
class StepState:
    """The step (= steps committed) and its phase, with what the protocol carries between phases."""

    step: int = 0
    phase: Phase = Phase.IDLE
    last_found_inf: int = -1  # GradScaler verdict of the last commit; -1 unknown (start, after a replay)
    holding: bool = True  # the live state is `step`'s (False while a replay may have half written it)
    voted_found_inf: int = 0  # PREPARED: this rank's local verdict on the step it voted for
    committed_aux: dict[str, Any] = field(default_factory=dict)  # RNG/extra as of the last commit
    prepared_aux: dict[str, Any] | None = None  # PREPARED: RNG/extra after this step, kept if it commits
    diverged_at: int = 0  # the step whose fingerprint compare found replicas diverged (0: none since the last join)
    agreed: int = NONE  # the step of this rank's copy of its last agreed state (agreed_state.AgreedCopy)
    # commit-once-per-step bookkeeping of `job.steps()`: the step yielded (None outside the loop)
    yielded: int | None = None
    commits_in_step: int = 0

    def _to(self, new: Phase) -> None:
        if new not in TRANSITIONS[self.phase]:
            raise ProtocolError(f"step {self.step}: {self.phase.name} -> {new.name} is not a protocol transition")
        self.phase = new

    # ---- one step -------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        """This step's gradients are synced (sync is idempotent within a step)."""
        return self.phase in (Phase.SYNCED, Phase.PREPARED)

    @property
    def prepared(self) -> bool:
        return self.phase is Phase.PREPARED

    def mark_synced(self) -> None:
        self._to(Phase.SYNCED)

    def prepare(self, aux: dict[str, Any], found_inf: int) -> None:
        self._to(Phase.PREPARED)
        self.prepared_aux, self.voted_found_inf = aux, found_inf

    def commit(self, found_inf: int) -> None:
        """The optimizer stepped with verdict `found_inf`: on to the next step."""
        self._to(Phase.COMMITTED)
        self.last_found_inf = found_inf
        if self.prepared_aux is not None:  # None only solo, where nothing is ever replayed
            self.committed_aux = self.prepared_aux
        self.step += 1
        self._next()

    def abort(self) -> None:
        """Abandon the step (nothing applied); recovery decides where training resumes."""
        if self.phase in (Phase.SYNCED, Phase.PREPARED):
            self._to(Phase.ABORTED)
        self._next()

    def _next(self) -> None:
        self.prepared_aux = None
        self._to(Phase.IDLE)

    # ---- recovery ---------------------------------------------------------------------
    def agreement_row(self) -> tuple[int, int, int, int, int]:
        """(step, prepared, found_inf, diverged_at, agreed) for the recovery's agreement
        (recovery.agree, agreed_state.plan); NONE for a rank whose live state a cut-off
        replay left half written."""
        tail = (self.diverged_at, self.agreed)
        if not self.holding:
            return (NONE, 0, -1, *tail)
        if self.prepared:
            return (self.step, 1, self.voted_found_inf, *tail)
        return (self.step, 0, self.last_found_inf, *tail)

    def discard(self) -> None:
        """The live state is about to be overwritten in place by a replay: until one
        completes (`replayed`) this rank holds no step (its agreement row says NONE), so no
        agreement counts it a holder and no rollback takes its half-written live state for
        a snapshot's step. `step` stays the last one it held (what its reports say)."""
        if self.phase is not Phase.IDLE:
            raise ProtocolError(f"step {self.step}: the state cannot be discarded in phase {self.phase.name}")
        self.holding, self.last_found_inf = False, -1

    def replayed(self, step: int, aux: dict[str, Any]) -> None:
        """State arrived from a replica: its step, and this rank's aux as restored."""
        self.step, self.committed_aux, self.last_found_inf, self.holding = step, aux, -1, True

    # ---- `for step in job.steps(total)` -------------------------------------------------
    def open_step(self) -> None:
        self.yielded, self.commits_in_step = self.step, 0

    def close_step(self) -> int:
        """Commits seen since open_step (the loop requires exactly one)."""
        n, self.yielded = self.commits_in_step, None
        return n

    def count_commit(self) -> int | None:
        """Count a commit; returns the step yielded if it is the second commit in that step."""
        if self.yielded is None:
            return None
        self.commits_in_step += 1
        return self.yielded if self.commits_in_step > 1 else None
