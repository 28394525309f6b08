"""bench/shrink.py's pure parts: step rates and the next epoch's first step from events."""

from __future__ import annotations

import pytest

from bench.shrink import next_epoch_step, step_rate

pytestmark = pytest.mark.timeout(30)


def _progress(t: float, step: int) -> dict[str, object]:
    return {"event": "progress", "t_mono": t, "step": step}


def test_the_step_rate_is_the_steps_over_the_seconds_between_the_window_s_first_and_last_points() -> None:
    evs = [_progress(1.0, 10), _progress(2.0, 30), _progress(3.0, 50), _progress(9.0, 200)]
    assert step_rate(evs, 1.0, 3.0) == pytest.approx(20.0)
    assert step_rate(evs, 0.0, 2.5) == pytest.approx(20.0)
    assert step_rate(evs, 2.5, 3.5) is None  # one point: no rate
    assert step_rate([{"event": "membership", "t_mono": 1.0}], 0.0, 9.0) is None


def test_the_next_epoch_s_first_full_strength_step() -> None:
    evs = [
        {"event": "full_strength_step", "epoch": 1, "t_mono": 1.0},
        {"event": "progress", "epoch": 2, "t_mono": 2.0},
        {"event": "full_strength_step", "epoch": 2, "t_mono": 3.0},
        {"event": "full_strength_step", "epoch": 3, "t_mono": 4.0},
    ]
    assert next_epoch_step(evs, 1) == evs[2]
    assert next_epoch_step(evs, 2) == evs[3]
    assert next_epoch_step(evs, 3) is None
