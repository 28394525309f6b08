"""`--snapshot-every auto`: the cadence that keeps what snapshots cost the training loop
under `--snapshot-budget` of its step, agreed in the commit vote so that every rank
snapshots the same steps.

What a snapshot costs is measured where it is paid, on the training thread's clock: the
commit-to-commit intervals from its capture until the vote confirms every rank's exchange
done, less as many intervals of a step with no snapshot in flight (the median of recent
ones). That counts the capture, and the CPU and memory bandwidth the exchange takes from
training on a busy host, and nothing where the host has cores and bandwidth to spare.

Agreement: each rank votes for the cadence it wants as one count in one of BUCKETS (powers
of two), summed in the commit vote; the cadence of a step is the largest bucket any rank
voted for in that step's vote. It is a pure function of that one vote, so a spare that
joined mid-run, with none of the others' history, decides as they do. A rank that has not
measured yet votes PROBE_EVERY: its first snapshots leave steps between them to measure.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

BUCKETS: tuple[int, ...] = tuple(1 << i for i in range(11))  # 1 .. 1024 steps between snapshots
PROBE_EVERY = 8
CLEAN_KEPT = 16  # intervals with no snapshot in flight: their median is a step's own time
COSTS_KEPT = 5  # snapshots' measured costs: their median is what one costs
CLEAN_NEEDED = 4  # before a rank votes from its own measure
WARMUP_INTERVALS = 5  # at the start and after a recovery: the loop's own warm-up, not its step
STALE_COMMITS = 64  # a step's own time measured no later than this many commits ago, or re-measured
DOWN_MARGIN = 0.75  # a rank asks for a shorter cadence only once it fits under this share of the budget


def bucket(every: int) -> int:
    """The smallest bucket of at least `every` steps (the last if none)."""
    return next((b for b in BUCKETS if b >= every), BUCKETS[-1])


def wanted_every(cost_s: float, step_s: float, budget: float) -> int:
    """The fewest steps between snapshots that keep cost_s / (every x step_s) <= budget."""
    if cost_s <= 0:
        return BUCKETS[0]
    if step_s <= 0 or budget <= 0:
        return BUCKETS[-1]
    return next((b for b in BUCKETS if cost_s <= budget * b * step_s), BUCKETS[-1])


def vote_terms(every: int) -> list[int]:
    """This rank's part of the commit vote: one count in `every`'s bucket."""
    b = bucket(every)
    return [int(x == b) for x in BUCKETS]


def agreed(sums: Sequence[int]) -> int | None:
    """The step's cadence from the summed vote: the largest bucket anyone asked for."""
    if len(sums) != len(BUCKETS):
        raise ValueError(f"snapshot cadence vote has {len(sums)} terms, not {len(BUCKETS)}")
    return next((b for b, n in zip(reversed(BUCKETS), reversed(sums)) if n > 0), None)


@dataclass(frozen=True)
class Want:
    every: int
    reason: str
    cost_s: float | None = None  # one snapshot's measured cost
    step_s: float | None = None  # a step's own time, no snapshot in flight


class SnapshotMeter:
    """One rank's measure of its snapshots' cost, fed at every commit (injected clock)."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._last_s: float | None = None
        self._clean: deque[float] = deque(maxlen=CLEAN_KEPT)
        self._costs: deque[float] = deque(maxlen=COSTS_KEPT)
        self._window: list[float] | None = None  # intervals of the snapshot in flight
        self._counts = False  # whether the window in flight started with a baseline to compare to
        self._asked: int | None = None  # the cadence it asked for last (hysteresis)
        self._skip = WARMUP_INTERVALS  # intervals still ignored
        self._commits = 0
        self._clean_at = 0  # the commit of the newest clean interval

    def commit(self, now_s: float, confirmed: bool, started: bool) -> None:
        """At a commit: the interval since the last one belonged to the open window (if a
        snapshot was in flight) or was clean. `confirmed`: the vote said every exchange is
        done (the window closes); `started`: a snapshot was captured now (one opens)."""
        self._commits += 1
        if self._last_s is not None:
            dur = now_s - self._last_s
            if self._skip > 0:
                self._skip -= 1
                self._counts = False  # a window over warm-up steps measures the warm-up
            elif self._window is not None:
                self._window.append(dur)
            else:
                self._clean.append(dur)
                self._clean_at = self._commits
        self._last_s = now_s
        if confirmed and self._window is not None:
            if self._window and self._counts:
                base = statistics.median(self._clean)
                self._costs.append(max(0.0, sum(self._window) - base * len(self._window)))
            self._window = None
        if started:
            # Not counted unless steps were timed before it: the first snapshots (at the start,
            # after a recovery) share their steps with the loop's own warm-up.
            self._window, self._counts = [], len(self._clean) >= CLEAN_NEEDED

    def interrupted(self) -> None:
        """A recovery: the interval across it measures nothing, the window in flight is lost,
        and the loop warms up again."""
        self._last_s = None
        self._window = None
        self._skip = WARMUP_INTERVALS

    def want(self) -> Want:
        if len(self._clean) < CLEAN_NEEDED or not self._costs:
            return Want(PROBE_EVERY, "not measured yet")
        if self._commits - self._clean_at > STALE_COMMITS:
            # Snapshots back to back (a cadence of 1, or an exchange longer than the cadence)
            # leave no step to measure against: a step's time from long ago would make any
            # cost look free. Ask for steps between them until there are new ones.
            self._asked = max(self._asked or 0, PROBE_EVERY)
            return Want(self._asked, "re-measuring a step without a snapshot")
        cost, step = statistics.median(self._costs), statistics.median(self._clean)
        every = wanted_every(cost, step, self.budget)
        if self._asked is not None and every < self._asked:
            # Down only with room to spare: a cost near a bucket's edge would flip the
            # cadence (and say so) at every other snapshot.
            every = max(every, wanted_every(cost, step, self.budget * DOWN_MARGIN))
        self._asked = every
        return Want(every, f"{cost * 1e3:.1f} ms a snapshot, {step * 1e3:.1f} ms a step", cost, step)
