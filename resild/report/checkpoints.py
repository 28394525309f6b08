"""What became of a job's disk checkpoints, from its events alone (rank 0 reports each
save's end: launcher.worker.redundancy.coordinator). resil-run's summary and `resild report` agree."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from resild.events.schema import EventName


@dataclass
class CheckpointCounts:
    saved: int = 0
    failed: int = 0  # the save itself failed (disk, a rank's error), or never ended
    abandoned: int = 0  # a recovery cut it short: the next cadence saves again
    deferred: int = 0  # due saves that waited for a writer still busy (or a broken group)
    loaded: int = 0
    last_saved_step: int | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        out = f"disk checkpoints: {self.saved} saved"
        if self.last_saved_step is not None:
            out += f" (newest step {self.last_saved_step})"
        out += f", {self.failed} failed, {self.abandoned} abandoned by a recovery, {self.deferred} deferred"
        if self.loaded:
            out += f", {self.loaded} loaded"
        if self.last_error:
            out += f"; last error: {self.last_error[:200]}"
        return out


def checkpoint_counts(events: list[dict[str, Any]]) -> CheckpointCounts | None:
    """None when the job wrote no checkpoint event (no --checkpoint-dir, or none due yet)."""
    c = CheckpointCounts()
    seen = False
    for e in events:
        name = e.get("event")
        if name == EventName.CHECKPOINT_SAVED:
            c.saved += 1
            step = e.get("step")
            if isinstance(step, int) and (c.last_saved_step is None or step > c.last_saved_step):
                c.last_saved_step = step
        elif name == EventName.CHECKPOINT_FAILED:
            if e.get("abandoned") is True:
                c.abandoned += 1
            else:
                c.failed += 1
                c.last_error = str(e.get("error") or "")[:500] or None
        elif name == EventName.CHECKPOINT_DEFERRED:
            c.deferred += 1
        elif name == EventName.CHECKPOINT_LOADED:
            c.loaded += 1
        else:
            continue
        seen = True
    return c if seen else None
