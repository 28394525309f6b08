"""Pure parts of the controller."""

from __future__ import annotations

import pytest

from resild.controller.effects import median_step_s


def test_median_step_counts_one_nodes_consecutive_steps_only() -> None:
    # Two nodes report every 5 steps, 16 ms a step, node B 4 ms behind node A: the job's step
    # advances alternately from A's and B's reports (s from A, s+1 from B 4 ms later).
    pts = []
    for k in range(10):
        base = 5 * k
        pts.append((base + 1, 0.080 * k, "a"))  # A reports step base+1
        pts.append((base + 2, 0.080 * k + 0.004, "b"))  # B reports base+2, 4 ms later
        pts.append((base + 3, 0.080 * k + 0.020, "b"))  # B's next step, 16 ms after its last
    assert median_step_s(pts) == pytest.approx(0.016)
    assert median_step_s([(1, 0.0, "a"), (2, 0.004, "b")]) is None  # no same-node pair: unknown
    assert median_step_s([]) is None
