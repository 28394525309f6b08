"""A rank's pace: the step's start to its arrival at commit, summed; the injected slowdown."""

from __future__ import annotations

import time

import pytest

from launcher.worker.pace import Pace


def test_a_pace_spans_the_step_to_the_commit_and_adds_up() -> None:
    p = Pace()
    assert p.arrived() == 0.0 and p.total_s == 0.0  # a commit outside the loop: nothing to time
    p.opened()
    time.sleep(0.02)
    first = p.arrived()
    assert 0.02 <= first < 0.5
    assert p.arrived() == 0.0  # the same step does not count twice
    p.opened()
    second = p.arrived()
    assert p.total_s == pytest.approx(first + second)


def test_an_injected_slowdown_adds_its_share_of_the_step() -> None:
    p = Pace()
    p.slow_pct = 100
    p.opened()
    time.sleep(0.03)
    assert p.arrived() >= 0.06
