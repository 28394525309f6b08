"""The job's restore sources, in the order they are tried, and the loop that tries them.

A new source is one new module with a class that has `name`, `build(ctx)`, `restore`,
`fresh_start` and `ahead` (launcher.worker.sources.base.StateSource), plus one entry in
`SOURCES` below (and its name in resild.events.schema.RestoreSource).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from launcher.worker.sources.base import IMPOSSIBLE, Need, Restored, StateSource, Unavailable
from launcher.worker.sources.checkpoint import CheckpointSource
from launcher.worker.sources.context import SourceContext
from launcher.worker.sources.replica import ReplicaSource
from launcher.worker.sources.snapshot import SnapshotSource
from resild.events.schema import RestoreSource

# Tried in this order: the cheapest first (a replica redoes nothing, a snapshot redoes the
# steps since it, a disk checkpoint many more). Each builder returns None when the job's
# layout or flags do not enable its source.
SOURCES: tuple[Callable[[SourceContext], StateSource | None], ...] = (
    ReplicaSource.build,
    SnapshotSource.build,
    CheckpointSource.build,
)


class Exhausted(RuntimeError):
    """No source could restore the state: str() is the job's one-line error."""


def build(ctx: SourceContext) -> list[StateSource]:
    return [s for s in (make(ctx) for make in SOURCES) if s is not None]


def restore(sources: Sequence[StateSource], need: Need) -> Restored:
    """The first source that restores every rank; then, at step 0, what a source can resume
    a fresh start from. Every rank runs the same sequence (each source is collective)."""
    reasons: list[str] = []
    last: RestoreSource | None = None
    for s in sources:
        try:
            got = s.restore(need, "; ".join(reasons))
        except Unavailable as e:
            reasons.append(str(e))
            last = s.name
            continue
        if got.step == 0 and not got.loaded:  # a requeued or resubmitted job: resume from disk
            for f in sources:
                fresh = f.fresh_start()
                if fresh is not None:
                    return fresh
        return got
    why = "; ".join(reasons) or "no restore source"
    # Told to restart from a disk checkpoint unless the last thing that failed was one.
    raise Exhausted(why if last is RestoreSource.CHECKPOINT else why + IMPOSSIBLE)
