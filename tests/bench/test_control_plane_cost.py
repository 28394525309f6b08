"""bench/control_plane_cost.py's step split (pure); the bench itself runs by hand."""

from __future__ import annotations

import pytest

from bench.control_plane_cost import Window, split_steps

WINDOWS = [Window(0.0, 1.0, True), Window(1.0, 2.0, False)]


def test_steps_are_split_by_the_window_they_ran_in() -> None:
    # [step, t_top, t_commit, t_end]
    steps = [[0, 0.0, 0.05, 0.1], [1, 0.1, 0.2, 0.3], [2, 0.3, 0.35, 0.4], [3, 1.1, 1.2, 1.3], [4, 1.3, 1.4, 1.5]]
    out = split_steps(steps, WINDOWS, settle_s=0.05)
    assert out["paused"] == pytest.approx([0.2, 0.1])  # steps 1 and 2
    assert out["running"] == pytest.approx([0.2])  # step 4; step 3 began in the pause


def test_a_step_across_a_boundary_or_at_a_window_start_counts_nowhere() -> None:
    steps = [[0, 0.0, 0.5, 0.9], [1, 0.9, 1.0, 1.1], [2, 1.1, 1.15, 1.2]]
    assert split_steps(steps, WINDOWS, settle_s=0.0)["running"] == pytest.approx([0.1])  # step 2 only
    assert split_steps(steps, WINDOWS, settle_s=0.2) == {"paused": [], "running": []}
