"""This rank's own pace: its compute per step, measured without a collective.

From the step's start (`job.steps()` yields it) to the rank's arrival at `job.commit()`:
the forward, backward and optimizer work of the loop, not the wait for the others inside
the vote. The commit report carries the running total (`paced_s`); the node process turns
totals into each rank's mean pace over the steps since its last report
(launcher.node.relay.CommitAggregator), and the control plane's straggler policy reads
them. For DDP and FSDP2 the backward's own collectives wait for
the slowest rank inside that span, so their paces come out alike: a straggler is then
found only where it computes outside them (resild's own gradient sync, the optimizer).

Off (`--stragglers off`, WELCOME's `pace`): nothing is timed and the commit reports carry
no `paced_s` (the node then sends no paces); an injected slowdown still times the steps it
slows, which it needs to slow them in proportion.
"""

from __future__ import annotations

import time


class Pace:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False (--stragglers off): no pace measured nor reported
        self._t_open: float | None = None
        self.total_s = 0.0  # every step's pace so far, this process
        self.slow_pct = 0  # fault injection (slow:NODE@STEP+PCT%): this share of each step added

    def opened(self) -> None:
        """The loop starts a step."""
        if self.enabled or self.slow_pct:
            self._t_open = time.monotonic()

    def arrived(self) -> float:
        """The loop reached commit(): this step's pace (seconds; 0 outside the loop or off)."""
        t_open, self._t_open = self._t_open, None
        if t_open is None:
            return 0.0
        pace_s = time.monotonic() - t_open
        if self.slow_pct:  # as a throttled GPU would: slower in proportion to the work
            time.sleep(pace_s * self.slow_pct / 100)
            pace_s = time.monotonic() - t_open
        if not self.enabled:
            return 0.0
        self.total_s += pace_s
        return pace_s

    def report(self) -> dict[str, float]:
        """What a commit's progress report carries: the running total, or nothing when off."""
        return {"paced_s": round(self.total_s, 6)} if self.enabled else {}
