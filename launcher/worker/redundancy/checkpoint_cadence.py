"""When a disk checkpoint starts: a pure function of the step and of what the commit vote
said about every rank's checkpoint writer.

A checkpoint is due every `every` committed steps. It starts only when the vote said no
rank is still writing one (a slow file system, a save of a failed epoch still finishing),
so the training thread never waits on a disk and every rank decides alike: the decision
uses only what the vote told all of them. A due checkpoint that finds a writer busy is
deferred (kept pending) and starts at the first commit after every writer is idle.

The vote's sum of `flag()`s: 0 every writer idle; 1..BROKEN-1 that many ranks still
writing; BROKEN or more: some rank's checkpoint group latched an error outside a recovery
(a collective timed out), and no checkpoint can run until a recovery forms it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

BROKEN = 1 << 20


def flag(busy: bool, broken: bool) -> int:
    """This rank's part of the commit vote."""
    return BROKEN if broken else int(busy)


class Action(enum.Enum):
    NONE = "none"  # nothing due
    SAVE = "save"
    DEFER = "defer"  # due, but a writer is busy: kept pending
    OFF = "off"  # due, but a checkpoint group is broken until the next recovery


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    first: bool = False  # the first DEFER/OFF of this pending checkpoint (report it once)


@dataclass
class CheckpointCadence:
    """Identical on every rank: it changes only on a commit (with the vote's sum) and on
    a recovery, which every rank of the new epoch (a spare too) goes through."""

    every: int
    pending: int | None = None  # the due step not yet started (deferred)
    reported: bool = False  # its deferral has been reported

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def on_commit(self, step: int, writers: int) -> Decision:
        """`writers`: the vote's sum of every rank's `flag()` for this step."""
        if self.due(step):
            self.pending = step
        if self.pending is None:
            return Decision(Action.NONE)
        if writers == 0:
            self.pending, self.reported = None, False
            return Decision(Action.SAVE)
        first, self.reported = not self.reported, True
        if writers >= BROKEN:
            return Decision(Action.OFF, "a checkpoint group failed outside a recovery: off until the next one", first)
        return Decision(Action.DEFER, f"{writers} rank(s) still writing the previous checkpoint", first)

    def after_recovery(self) -> None:
        """A spare starts with a fresh cadence: every rank forgets a deferred checkpoint
        (the next one is the next due step)."""
        self.pending, self.reported = None, False
