"""The control link's thread sleeps as long as no wait report can fall due (pure rule)."""

from __future__ import annotations

import pytest

from launcher.worker.controller_link import report_poll_s


def test_nothing_in_flight_sleeps_a_whole_report_interval() -> None:
    # A collective starting now cannot be blocked for 0.5 s before 0.5 s from now.
    assert report_poll_s(0.0, False, 0.5) == pytest.approx(0.505)
    assert report_poll_s(0.0, False, 5.0) == 1.0  # capped at 1 s, a safety net


def test_a_collective_in_flight_wakes_the_thread_when_its_report_is_due() -> None:
    assert report_poll_s(0.7, False, 1.0) == pytest.approx(0.305)
    assert report_poll_s(2.0, False, 1.0) == 0.01  # overdue: at once (never a busy loop)


def test_a_reported_wait_is_looked_at_often_to_say_when_it_clears() -> None:
    assert report_poll_s(3.0, True, 1.0) == 0.1
