"""Stragglers: a node that is persistently slower than the job's others (pure policy).

A synchronous job runs at its slowest rank's pace. Each worker measures its own pace per
step (the step's start to its arrival at `job.commit()`: its compute, not the wait for
others in the vote) and its node aggregates it into the commit reports it already sends
(launcher.node.relay.CommitAggregator): no extra collective. The controller keeps, per
node, the paces of its latest reported steps (`Paces`) and here decides:

    a node whose median pace over its window is more than `threshold` above the median of
    the other nodes' is a straggler (`find`): a one-off slow step moves no median, and the
    window starts again at every epoch (a recovery) after `WARMUP_STEPS`.

    replacing it pays (`pays`) when the time it costs the rest of the run (its excess pace
    times the steps left) exceeds what a recovery costs this job (its own recoveries'
    median, or `PRIOR_RECOVERY_S` before it has had one).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

WARMUP_STEPS = 5  # steps of each epoch not judged: start-up, a recovery's first steps (graphs, caches)
PRIOR_RECOVERY_S = 5.0  # what a replacement is assumed to cost before the job has measured one
STRAGGLER_CHECK_S = 1.0  # the controller looks this often (a straggler costs seconds, not milliseconds)


@dataclass(frozen=True)
class Straggler:
    node: str
    slowdown: float  # its pace / the others' median pace - 1
    pace_s: float  # its median pace over the window
    others_s: float  # the other nodes' median pace
    steps: int  # steps in its window


def find(paces: Mapping[str, Sequence[float]], window: int, threshold: float) -> Straggler | None:
    """Pure. `paces[node]`: its latest per-step paces (seconds), oldest first. The slowest
    node whose window is full and whose median is more than `threshold` above the median of
    the other full windows; None if there is none (or fewer than two nodes to compare)."""
    medians = {n: statistics.median(v[-window:]) for n, v in paces.items() if len(v) >= window}
    if len(medians) < 2:
        return None
    worst: Straggler | None = None
    for node, mine in medians.items():
        others = statistics.median(m for n, m in medians.items() if n != node)
        if others <= 0:
            continue
        slow = mine / others - 1
        if slow > threshold and (worst is None or slow > worst.slowdown):
            worst = Straggler(node, slow, mine, others, window)
    return worst


def window_too_long(window: int, steps_planned: int) -> str | None:
    """Pure: why no straggler can be found in a job of `steps_planned` steps (its loop's
    total, as the ranks say; 0: not said yet), or None."""
    need = WARMUP_STEPS + window
    if steps_planned <= 0 or need <= steps_planned:
        return None
    return (
        f"--straggler-window {window} needs {need} steps of an epoch ({WARMUP_STEPS} not judged after a start or "
        f"a recovery) and this job has {steps_planned}: no straggler can be found; pass a shorter --straggler-window"
    )


def pays(s: Straggler, steps_left: int, recovery_s: float) -> tuple[bool, float]:
    """Pure: -> (replace it?, the seconds it would cost the rest of the run). Without it the
    job steps at about the others' pace."""
    cost_s = max(0, steps_left) * (s.pace_s - s.others_s)
    return cost_s > recovery_s, cost_s


@dataclass
class Paces:
    """Per node, the paces of its latest steps in the current epoch (the controller's)."""

    window: int
    epoch: int = 0
    first_step: dict[str, int] = field(default_factory=dict)  # node -> its first step seen this epoch
    by_node: dict[str, deque[float]] = field(default_factory=dict)

    def add(self, node: str, epoch: int, step: int, pace_s: float, steps: int = 1) -> None:
        """`steps` steps ending at `step` took `pace_s` each (a report's mean)."""
        if epoch < self.epoch or pace_s <= 0 or steps <= 0:
            return
        if epoch > self.epoch:  # a recovery: paces from before it say nothing about now
            self.epoch, self.first_step, self.by_node = epoch, {}, {}
        first = self.first_step.setdefault(node, step - steps + 1)
        fresh = min(steps, step - (first + WARMUP_STEPS) + 1)
        if fresh <= 0:
            return
        q = self.by_node.setdefault(node, deque(maxlen=self.window))
        q.extend([pace_s] * fresh)

    def forget(self, node: str) -> None:
        self.by_node.pop(node, None)
        self.first_step.pop(node, None)

    def view(self) -> dict[str, list[float]]:
        return {n: list(q) for n, q in self.by_node.items()}
